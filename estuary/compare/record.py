"""Records of finished methods (``<slug>/method.json``): a comparison run again into the
same directory reuses every method whose record matches its config and initial weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from estuary.compare.spec import Method, MethodRun
from shared.atomic import atomic_write
from shared.errors import ConfigError
from shared.methods.api import origin_of
from shared.methods.registry import make_algorithm
from shared.models.init import init_fingerprint
from shared.models.plan import parse_plan, plan_doc
from shared.models.pruning import PRUNING_RECIPE

#: file name of a finished method's record, inside its run directory
RECORD = "method.json"
#: version tag of the record; another tag is not reused, except :data:`RECORD_FORMAT_V1`
RECORD_FORMAT = "estuary.compare-method/2"
#: the tag before rows counted rounds from 1: its rows are read with ``round + 1``
RECORD_FORMAT_V1 = "estuary.compare-method/1"
#: a record larger than this is not read (rows of 10,000 rounds are well under it)
RECORD_MAX_BYTES = 64 * 2**20
#: what a record written before a key existed implies for it (earlier runs trained in fp32)
RECORD_DEFAULTS: dict[str, Any] = {"precision": "fp32"}
#: :func:`load_record`'s reason when the method has not finished before (nothing to report)
NO_RECORD = "no finished run"


def _training_key(m: Method) -> dict[str, Any]:
    """What a method's record must match beyond its config digest: how a centralized method
    trained (a record from before one optimizer per run and the weight average lacks it, so
    reruns), the pruning recipe of a method that prunes, which folders a folder run read
    (``data.local_dir`` and ``eval.reference_dir`` are per-process settings, outside the
    digest), and the precision it trained in (``train.precision``, per process too)."""
    key: dict[str, Any] = {"precision": m.cfg.train.precision}
    if m.centralized:
        key["centralized_training"] = {"optimizer": "one per run", "ema": m.ema}
    if m.cfg.algorithm.config().prunes:
        # a record of another recipe (or of a centralized method that versions before the
        # pruned ceiling trained dense) lacks this key or differs in it, so reruns
        key["pruning"] = PRUNING_RECIPE
    if m.cfg.data.dataset == "folder":
        key["folders"] = [str(Path(d).resolve()) if d else ""
                          for d in (m.cfg.data.local_dir, m.cfg.eval.reference_dir)]  # fmt: skip
    return key


def _final_ok(final: dict[str, Any]) -> bool:
    """Whether a record's ``final`` has the shape the tables read: ``accuracy`` (when
    present) a table of numbers by domain, ``mean_accuracy`` a number."""
    acc = final.get("accuracy")
    if acc is not None and not (
        isinstance(acc, dict)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in acc.values())
    ):
        return False
    mean = final.get("mean_accuracy")
    return mean is None or (isinstance(mean, (int, float)) and not isinstance(mean, bool))


def fingerprint(m: Method) -> str:
    """``m``'s ``model.init`` as :func:`~shared.models.init.init_fingerprint` names it now,
    with what else its first state derives from (PRISM: the key's fingerprint), so a run
    trained under another key is not reused."""
    init = init_fingerprint(m.cfg.model.preset, m.cfg.model.init)
    origin = None if m.centralized else origin_of(make_algorithm(m.cfg))
    return init if origin is None else f"{init}+{origin}"


def save_record(run: MethodRun, *, evaluate: bool, init: str | None = None) -> None:
    """Write ``run``'s record atomically, so a later comparison can reuse it; ``init`` is the
    fingerprint of the weights the run started from (default: the file as it is now)."""
    doc = {
        "format": RECORD_FORMAT,
        "label": run.method.label,
        "digest": run.method.cfg.digest(),
        "init": init or fingerprint(run.method),
        "centralized": run.method.centralized,
        **_training_key(run.method),
        "evaluate": evaluate,
        "rows": run.rows,
        "traffic": run.traffic,
        "plan": plan_doc(run.plan),
        "wall_s": run.wall_s,
        "steps": run.steps,
        "torch_threads": run.threads,
        "deterministic": run.deterministic,
        "final": run.final,
    }
    atomic_write(run.run_dir / RECORD, json.dumps(doc).encode())


def load_record(
    m: Method, run_dir: Path, *, evaluate: bool, init: str | None = None
) -> tuple[MethodRun | None, str]:
    """``m``'s finished run from ``run_dir / method.json``, or None and why it is not usable
    (``init``: ``m``'s init fingerprint, if the caller has it already)."""
    path = run_dir / RECORD
    if not path.is_file():
        return None, NO_RECORD
    if path.stat().st_size > RECORD_MAX_BYTES:
        return None, f"{path} is larger than {RECORD_MAX_BYTES} bytes"
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"{path} is not JSON ({e})"
    if not isinstance(doc, dict) or doc.get("format") not in (RECORD_FORMAT, RECORD_FORMAT_V1):
        return None, f"{path} is not a {RECORD_FORMAT} record"
    want = {
        "label": m.label,
        "digest": m.cfg.digest(),
        "init": init or fingerprint(m),
        "centralized": m.centralized,
        **_training_key(m),
        # an evaluated run serves a comparison without evaluation too (its FID is kept)
        "evaluate": evaluate or doc.get("evaluate") is True,
    }
    for key, value in want.items():
        got = doc.get(key, RECORD_DEFAULTS.get(key))
        if got != value:
            return None, f"{path} has {key} {got!r}, this comparison {value!r}"
    rows, traffic, plan, wall_s, steps = (
        doc.get(k) for k in ("rows", "traffic", "plan", "wall_s", "steps")
    )
    bad = f"{path}: rows, traffic, plan, wall_s or steps malformed"
    if not (
        isinstance(rows, list)
        and isinstance(traffic, dict)
        and (plan is None or isinstance(plan, dict))
        and isinstance(wall_s, (int, float))
        and isinstance(steps, list)
    ):
        return None, bad
    rows_ok = all(isinstance(r, dict) and isinstance(r.get("round"), int) for r in rows)
    steps_ok = len(steps) == m.cfg.run.rounds and all(isinstance(n, int) and n >= 0 for n in steps)
    if not (rows_ok and steps_ok):
        return None, bad
    if doc["format"] == RECORD_FORMAT_V1:  # its rows count rounds from 0
        rows = [{**r, "round": r["round"] + 1} for r in rows]
    threads = doc.get("torch_threads")
    if not (threads is None or (type(threads) is int and threads > 0)):
        return None, f"{path}: torch_threads {threads!r} is not a positive integer"
    deterministic = doc.get("deterministic")
    if not (deterministic is None or isinstance(deterministic, bool)):
        return None, f"{path}: deterministic {deterministic!r} is not true or false"
    final = doc.get("final")  # absent from a record of before it was kept: none reported
    if not (final is None or (isinstance(final, dict) and _final_ok(final))):
        return None, f"{path}: final {final!r} is not a table of the run's final figures"
    try:  # the one check of a plan read back from disk
        parsed = parse_plan(m.cfg.model.preset, plan)
    except ConfigError as err:
        return None, f"{path}: bad architecture plan: {err}"
    run = MethodRun(m, run_dir, rows, traffic, parsed, float(wall_s), steps, threads=threads,
                    deterministic=deterministic, final=final)  # fmt: skip
    return run, "finished earlier"
