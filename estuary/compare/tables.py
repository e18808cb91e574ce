"""A comparison's results: one table (``table.md``/``.csv``/``.json``; every byte and cost
column is defined in :mod:`shared.metrics.accounting`) and two plots (``quality.png``,
``bytes.png``) on the equal-compute axis of total local steps.

A comparison whose runs report per-domain accuracy (a run's ``final``: FedDEO, and a
classifier's final global model under ``data.domains``) gets FedDEO's table instead: a column
per domain, the mean, rounds and the bytes one device sent and fetched over the whole run
against the reference's, and ``accuracy_by_domain.png``."""

from __future__ import annotations

import csv
import io
import json
import statistics
from functools import partial
from pathlib import Path
from typing import Any

from estuary.compare.spec import CompareSpec, Method, MethodRun
from shared.atomic import atomic_write
from shared.metrics import accounting as acc
from shared.models.plan import build_model
from shared.models.presets import model_info

# -- the table -------------------------------------------------------------------------------
#: evaluations averaged in the "FID, mean of last k" column: one FID on a few hundred samples
#: swings by tens of points between neighbouring evaluations (up to 70 on 500 samples in
#: benchmarks/results/compare_cpu_tiny_xlong/), so a ranking read off the last one alone is
#: fragile where the curves have flattened
LAST_EVALS = 3
#: (key, header, decimals) of every table column; table.md, .csv and .json share the keys
COLUMNS: list[tuple[str, str, int]] = [
    ("method", "method", 0),
    ("algorithm", "algorithm", 0),
    ("fid", "FID", 2),
    ("fid_best", "best FID", 2),
    ("fid_last", f"FID, mean of last {LAST_EVALS}", 2),
    ("is", "IS", 2),
    ("params_m", "params (M)", 3),
    ("gmacs", "MACs (G)", 4),
    ("model_mib", "model MiB (V)", 3),
    ("cloud_mib_per_agg", "cloud-link MiB/agg", 3),
    ("cloud_mib_per_agg_analytic", "cloud-link MiB/agg (analytic)", 3),
    ("edge_mib_per_agg", "edge-link MiB/agg", 3),
    ("weighted_per_window", "weighted cost/window", 3),
    ("paper_cost_per_window", "Table IV rule/window", 3),
    ("total_mib", "total MiB", 2),
    ("device_up_bytes", "device upload B/round", 0),
    ("bits_per_weight", "upload bits/weight", 3),
    ("device_round_bytes", "device round B (down + up)", 0),
    ("rounds", "rounds", 0),
    ("central_aggs", "central aggs", 0),
    ("local_steps", "local steps", 0),
    ("wall_s", "wall s", 1),
]


#: the columns of a comparison of classifiers (pFedGPA and its baselines): the devices'
#: final-round accuracy on their own test splits instead of FID
CLASSIFIER_COLUMNS: list[tuple[str, str, int]] = [
    ("method", "method", 0),
    ("algorithm", "algorithm", 0),
    ("acc_before", "acc. before FT (%)", 2),
    ("acc_after", "acc. after FT (%)", 2),
    ("acc_std", "std over devices (pp)", 2),
    ("under60_before", "devices < 60 % before FT", 0),
    ("under60_after", "devices < 60 % after FT", 0),
    ("params", "params", 0),
    ("device_up_bytes", "device upload B/round", 0),
    ("device_down_bytes", "device download B/round", 0),
    ("total_mib", "total MiB", 2),
    ("rounds", "rounds", 0),
    ("local_steps", "local steps", 0),
    ("wall_s", "wall s", 1),
]


#: the columns of a comparison by per-domain accuracy (FedDEO and its baselines, seed 003's
#: Table 1) around the per-domain ones (``acc_<domain>``, :func:`domain_columns`)
DOMAIN_HEAD: list[tuple[str, str, int]] = [("method", "method", 0), ("algorithm", "algorithm", 0)]
DOMAIN_TAIL: list[tuple[str, str, int]] = [
    ("acc_mean", "mean (%)", 2),
    ("rounds", "rounds", 0),
    ("up_per_device", "upload B/device", 0),
    ("down_per_device", "download B/device", 0),
    ("up_vs_reference", "upload / reference's", -3),  # 3 significant digits
    ("total_mib", "total MiB", 2),
    ("wall_s", "wall s", 1),
]


def domain_columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """The columns of a per-domain table: one per domain any row scored (first seen first)."""
    domains = list(dict.fromkeys(d for r in rows for d in r.get("domains", ())))
    return [*DOMAIN_HEAD, *((f"acc_{d}", f"{d} (%)", 2) for d in domains), *DOMAIN_TAIL]


def by_domain(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows carry per-domain accuracy (a run's ``final``): the table is then
    :func:`domain_columns`'s."""
    return any(r.get("domains") for r in rows)


def columns_for(rows: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """The table's columns: per-domain accuracy and bytes per device when a run reports
    them (FedDEO), device accuracy for classifiers, FID and costs for generators."""
    if by_domain(rows):
        return domain_columns(rows)
    return CLASSIFIER_COLUMNS if any("acc_after" in r for r in rows) else COLUMNS


def _accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The final round's classifier figures in percent (the paper's "final round average
    test accuracy across clients"), none for a generator run."""
    last = next((r["accuracy"] for r in reversed(rows) if r.get("accuracy")), None)
    if last is None:
        return {}
    out = {
        "acc_after": 100 * last["after_mean"],
        "acc_std": 100 * last["after_std"],
        "under60_after": last["after_under_60"],
        "acc_devices": last["devices"],
    }
    if "before_mean" in last:
        out |= {"acc_before": 100 * last["before_mean"], "under60_before": last["before_under_60"]}
    return out


def _final_accuracy(run: MethodRun) -> dict[str, Any]:
    """The run's final per-domain figures in percent (``final``: a one-shot method's
    product, a classifier's final global model, a centralized classifier): ``acc_<domain>``,
    ``acc_mean``, the ``domains`` in order, the product's ``final_preset`` and, where the
    method scored several synthetic-set sizes (FedDEO's N), ``accuracy_by_n`` (N ->
    domain or ``mean`` -> %); none when it reports none."""
    final = run.final or {}
    scores = final.get("accuracy")
    if not isinstance(scores, dict) or not scores:
        return {}
    mean = final.get("mean_accuracy")
    out: dict[str, Any] = {
        "domains": list(scores),
        **{f"acc_{d}": 100 * v for d, v in scores.items()},
        "acc_mean": 100 * (mean if mean is not None else statistics.fmean(scores.values())),
        "final_preset": final.get("preset"),
    }
    if isinstance(final.get("accuracy_by_n"), dict):
        out["accuracy_by_n"] = {
            n: {d: 100 * v for d, v in acc.items()} for n, acc in final["accuracy_by_n"].items()
        }
    return out


def _upload_key(m: Method) -> str:
    """The traffic counter of what the method's devices upload: ``received:`` the blob kind
    of its algorithm's upload (``device_update``; FedDEO's ``description``)."""
    return "received:" + m.cfg.algorithm.config().traffic().blob_kind


def _per_device_bytes(run: MethodRun) -> dict[str, Any]:
    """What one device sent and fetched over the whole run, from the traffic counters: every
    upload blob the edges received (:func:`_upload_key`) and every model the devices
    fetched (``received:edge_model``, or their personal one), over ``federation.num_devices``
    (None for a centralized method: no federation, its data pooled by assumption)."""
    if run.method.centralized:
        return {"up_per_device": None, "down_per_device": None}
    counts = run.traffic.get("bytes", {})
    n = run.method.cfg.federation.num_devices
    up = counts.get(_upload_key(run.method), 0)
    down = sum(counts.get(f"received:{k}", 0) for k in ("edge_model", "personal_model"))
    return {"up_per_device": up / n, "down_per_device": down / n}


def _quality(rows: list[dict[str, Any]]) -> dict[str, Any]:
    q = [r["quality"] for r in rows if r.get("quality")]
    if not q:
        return {
            "fid": None, "fid_best": None, "fid_last": None, "is": None, "extractor": None,
            "n_fake": None, "fid_level": None,
        }  # fmt: skip
    return {
        "fid": q[-1]["fid"],
        "fid_best": min(x["fid"] for x in q),
        "fid_last": statistics.fmean(x["fid"] for x in q[-LAST_EVALS:]),
        "is": q[-1].get("is_mean"),
        "extractor": q[-1].get("extractor"),
        "n_fake": q[-1].get("n_fake"),
        # "client": the mean over the devices' own models (device-local parts)
        "fid_level": q[-1].get("level", "global"),
    }


def _algorithm(m: Method) -> str:
    settings, f = m.cfg.algorithm.config(), m.cfg.federation
    if m.centralized:  # the settings matter only where they prune the ceiling's model
        text = f"centralized ema={m.ema!r}" if m.ema else "centralized"
        note = settings.describe() if settings.prunes else ""
    else:
        text = f"{m.cfg.algorithm.name} r_e={f.edge_every} r_g={f.cloud_every}"
        note = settings.describe()
    return f"{text} {note}" if note else text


def _per_participant_steps(run: MethodRun) -> float:
    c = acc.participants_per_round(run.method.cfg.federation)
    return sum(run.steps) / (len(run.steps) * c)


def _comm(run: MethodRun, spec: CompareSpec, window: float, v: int) -> dict[str, Any]:
    """Byte and cost columns of a federated run (see :mod:`shared.metrics.accounting`)."""
    cfg, d = run.method.cfg, spec.distances
    fed, flat = cfg.federation, acc.is_flat(cfg.federation)
    ps = acc.periods(run.rows)
    mean = acc.mean_bytes(acc.steady_periods(ps, str(run.rows[-1].get("arch", "dense"))))
    cloud, edge = acc.long_link_bytes(mean, flat=flat)
    pl = acc.payloads(cfg, run.plan)
    predicted = acc.analytic_period(
        fed, down=pl.down, up=pl.up, edge_state=pl.edge_state, global_state=pl.global_state
    )
    everything = acc.split_received(run.traffic.get("bytes", {}))
    # what one device sends (and fetches) in a round, from the byte counters
    uploads = sum(r.get("updates", 0) for r in run.rows)
    up_key = _upload_key(run.method)
    up = sum(r.get("bytes", {}).get(up_key, 0) for r in run.rows)
    down = sum(  # the edge's model, or the device's personal one (pFedGPA)
        r.get("bytes", {}).get(f"received:{kind}", 0)
        for r in run.rows for kind in ("edge_model", "personal_model")
    )  # fmt: skip
    device_up = up / uploads if uploads else None
    s = _per_participant_steps(run)
    k_c, k_e = acc.aggregations_per_window(fed, steps_per_round=s, window_steps=window)
    paper = acc.paper_comm_cost(
        acc.mib(v), acc.participants_per_round(fed), cloud_aggs=k_c, edge_aggs=k_e,
        payload=pl.payload, d=d,
    )  # fmt: skip
    return {
        "cloud_bytes_per_agg": cloud,
        "edge_bytes_per_agg": edge,
        "cloud_mib_per_agg": acc.mib(cloud),
        "cloud_mib_per_agg_analytic": acc.mib(acc.long_link_bytes(predicted, flat=flat)[0]),
        "edge_mib_per_agg": acc.mib(edge),
        "weighted_per_window": acc.weighted_cost(mean, flat=flat, d=d) * k_c,
        "paper_cost_per_window": paper,
        "payload": pl.payload,
        "total_bytes": everything.total,
        "total_mib": acc.mib(everything.total),
        "device_up_bytes": device_up,
        "bits_per_weight": 8 * device_up / pl.model_params if device_up else None,
        "device_round_bytes": (up + down) / uploads if uploads else None,
        "central_aggs": len(ps),
        "steady_periods": len(acc.steady_periods(ps, str(run.rows[-1].get("arch", "dense")))),
        "flat": flat,
    }


def _no_comm() -> dict[str, Any]:
    zero = ("cloud_bytes_per_agg", "edge_bytes_per_agg", "cloud_mib_per_agg", "total_bytes")
    rest = ("cloud_mib_per_agg_analytic", "edge_mib_per_agg", "weighted_per_window")
    device = ("device_up_bytes", "bits_per_weight", "device_round_bytes")
    return {
        **dict.fromkeys(zero + rest, 0),
        **dict.fromkeys(device, 0),
        "paper_cost_per_window": 0.0,
        "total_mib": 0.0,
        "central_aggs": 0,
    }


def summarize(runs: list[MethodRun], spec: CompareSpec) -> list[dict[str, Any]]:
    """One table row per run; windows of equal compute are the reference's central
    aggregation period (per-participant local steps per round x its r_g). When a run
    reports per-domain accuracy (its ``final``), every row also gets its own
    (:func:`_final_accuracy`), the bytes one device sent and fetched over the run
    (:func:`_per_device_bytes`) and ``up_vs_reference``: its upload per device over the
    reference's (the reference's total over all its rounds)."""
    ref = next(r for r in runs if r.method.label == spec.reference)
    window = _per_participant_steps(ref) * ref.method.cfg.federation.cloud_every
    # per-domain accuracy (a run's final figures): bytes per device over the whole run too
    domains = any(_final_accuracy(run) for run in runs)
    out = []
    for run in runs:
        cfg = run.method.cfg
        info = model_info(
            cfg.model.preset, model_fn=partial(build_model, cfg.model.preset, run.plan)
        )
        row: dict[str, Any] = {
            "method": run.method.label,
            "algorithm": _algorithm(run.method),
            "centralized": run.method.centralized,
            **_quality(run.rows),
            **_accuracy(run.rows),
            "params": info.params,
            "params_m": info.params / 1e6,
            "macs": info.macs,
            "gmacs": info.macs / 1e9,
            "model_bytes": acc.fp32_bytes(info.params),
            "model_mib": acc.mib(acc.fp32_bytes(info.params)),
            **(_no_comm() if run.method.centralized else _comm(run, spec, window, info.fp32_bytes)),
            "rounds": cfg.run.rounds,
            "local_steps": sum(run.steps),
            "wall_s": run.wall_s,
            "torch_threads": run.threads,
            "deterministic": run.deterministic,
            "run_dir": run.run_dir.name,
            "local_parts": not run.method.centralized
            and cfg.algorithm.config().traffic().device_keeps == "local_parts",
        }
        if "device_round_bytes" in row and "device_up_bytes" in row:
            row["device_down_bytes"] = row["device_round_bytes"] - row["device_up_bytes"]
        if domains:
            row |= _final_accuracy(run) | _per_device_bytes(run)
        out.append(row)
    if domains:
        base = next(r["up_per_device"] for r in out if r["method"] == spec.reference)
        for row in out:
            up = row["up_per_device"]
            row["up_vs_reference"] = up / base if base and up is not None else None
    return out


def _ratios(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    ref = next(r for r in rows if r["method"] == reference)
    keys = ("cloud_mib_per_agg", "weighted_per_window", "paper_cost_per_window", "total_mib")
    out = []
    for r in rows:
        if r["method"] == reference or r["centralized"]:
            continue
        ratio = {k: (r[k] / ref[k] if ref[k] else None) for k in keys}
        out.append({"method": r["method"], **ratio})
    return out


def _fmt(value: Any, decimals: int) -> str:
    """A table cell: ``decimals`` places, or ``-decimals`` significant digits when negative
    (ratios spanning orders of magnitude), ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, float) and decimals < 0:
        return f"{value:.{-decimals}g}"
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    return str(value)


def markdown(rows: list[dict[str, Any]], spec: CompareSpec) -> str:
    """``table.md``: the table, the ratios to the reference and what the columns mean."""
    columns = columns_for(rows)
    if by_domain(rows):
        return _domain_markdown(rows, spec)
    if columns is CLASSIFIER_COLUMNS:
        return _classifier_markdown(rows, spec)
    lines = [
        f"# {spec.name}",
        "",
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), n) for k, _, n in columns) + " |")
    lines += ["", f"Relative to {spec.reference}:", ""]
    lines += [
        "| method | cloud-link bytes/agg | weighted cost/window | Table IV rule | total bytes |"
    ]
    lines += ["|---|---|---|---|---|"]
    for q in _ratios(rows, spec.reference):
        cells = [_fmt(q[k], 3) for k in list(q)[1:]]
        lines.append(f"| {q['method']} | " + " | ".join(cells) + " |")
    ex = next((r for r in rows if r.get("extractor")), None)
    d = spec.distances
    lines += [
        "",
        f"FID / IS: last evaluation ({ex['extractor']} features, {ex['n_fake']} samples); "
        f"FID, mean of last {LAST_EVALS}: the mean over the last {LAST_EVALS} evaluations "
        "(fewer where fewer were made), steadier than one evaluation"
        if ex
        else "FID / IS: not evaluated",
        *(
            [
                "FID / IS of "
                + ", ".join(clients)
                + ": means over the devices' own models (global federated parts with each "
                "device's local parts; eval.clients devices), as the paper measures them"
            ]
            if (clients := [r["method"] for r in rows if r.get("fid_level") == "client"])
            else []
        ),
        *(
            [
                "Bytes of "
                + ", ".join(local)
                + ": measured includes each device's and edge's one whole-model download (the "
                "initial local parts); the analytic column is the steady state after it"
            ]
            if (local := [r["method"] for r in rows if r.get("local_parts")])
            else []
        ),
        *(
            [
                "torch threads: "
                + ", ".join(f"{r['method']} {r.get('torch_threads') or '?'}" for r in rows)
                + " (a CPU run repeats bit for bit at the same thread count, not across counts)"
            ]
            if any(r.get("torch_threads") for r in rows)
            else []
        ),
        *(
            [
                "deterministic kernels (compute.deterministic): "
                + ", ".join(r["method"] for r in rows if r.get("deterministic"))
                + " (a GPU run repeats bit for bit only with them)"
            ]
            if any(r.get("deterministic") for r in rows)
            else []
        ),
        "device upload B/round: the bytes of one device's upload blob, mean over every "
        "upload of the run (received:device_update / updates); upload bits/weight: 8 x that "
        "/ params; device round B: that plus the device's download of the edge model.",
        "MiB = 2^20 bytes (the paper's MB). V = 4 B x params of the final model. "
        "agg = one central aggregation period; per-agg and per-window figures are means over the "
        "periods trained on the final architecture, totals cover the whole run. "
        "cloud-link = bytes over the link to the cloud (edge<->cloud when r_e < r_g; "
        "device<->edge when r_e = r_g, the edges being the cloud's ingress); "
        f"weighted cost = 0.02*d_c*MiB(cloud link) + 0.002*d_e*MiB(edge link), d_e = {d.d_e}, "
        f"d_c = {d.d_c}, per window = {spec.reference}'s central aggregation of local compute; "
        "Table IV rule = V*C*payload*(k_c*0.02*d_c + k_e*0.002*d_e) "
        "(shared/metrics/accounting.py). "
        "total = every byte received (models and control messages).",
        "",
    ]
    return "\n".join(lines)


def _classifier_markdown(rows: list[dict[str, Any]], spec: CompareSpec) -> str:
    """``table.md`` of a comparison of classifiers."""
    cols = CLASSIFIER_COLUMNS
    lines = [f"# {spec.name}", "", "| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]  # fmt: skip
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), n) for k, _, n in cols) + " |")
    lines += [
        "",
        "Accuracy: each device's classifier on its own test split (drawn from the test set by "
        "the training split's rule), averaged over the devices, in the final round. Before FT: "
        "the model the device received (FedAvg: the global model; pFedGPA: its personal "
        "parameters; Local-only: its own model of the round before); after FT: after its "
        "local round (FedAvg's is FedAvg-FT). std: over the devices, after FT.",
        "device upload B/round: one device's upload blob (mean over the run); download: the "
        "model it fetched a round (the edge's, or its personal one). total = every byte "
        "received, control messages and edges' forwarding included.",
        "",
    ]
    return "\n".join(lines)


def _domain_markdown(rows: list[dict[str, Any]], spec: CompareSpec) -> str:
    """``table.md`` of a comparison by per-domain accuracy (FedDEO's Table 1 layout), with
    the accuracy by synthetic images per class of the methods that scored several."""
    cols = domain_columns(rows)
    lines = [f"# {spec.name}", "", "| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]  # fmt: skip
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(k), n) for k, _, n in cols) + " |")
    by_n = [r for r in rows if r.get("accuracy_by_n")]
    if by_n:
        domains = list(dict.fromkeys(d for r in by_n for d in r["domains"]))
        lines += ["", "Accuracy (%) by synthetic images per (device, class), N:", "",
                  "| method | N | " + " | ".join(domains) + " | mean |",
                  "|" + "|".join("---" for _ in range(len(domains) + 3)) + "|"]  # fmt: skip
        for r in by_n:
            for n, acc in sorted(r["accuracy_by_n"].items(), key=lambda kv: int(kv[0])):
                cells = [_fmt(acc.get(d), 2) for d in [*domains, "mean"]]
                lines.append(f"| {r['method']} | {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Accuracy: the method's final classifier (FedDEO, Prompts-Only: the one the cloud "
        "trains on its synthetic images; a federated classifier: the final global model; "
        "centralized: one model trained on the pooled real data of every device) on the whole "
        "test set seen in each domain (data.domains; identity alone without them), top-1 in "
        "%; mean: unweighted over the domains.",
        "upload B/device: every upload blob the edges received over the whole run "
        "(received:device_update; FedDEO's received:description; all rounds) over the number "
        "of devices; download B/device: "
        "every model the devices fetched (received:edge_model), over the devices. upload / "
        f"reference's: that upload over {spec.reference}'s, its total over its "
        f"{next((r['rounds'] for r in rows if r['method'] == spec.reference), '?')} rounds "
        "(centralized: no federation, '-'). total = every byte received, control messages and "
        "edges' forwarding included.",
        "",
    ]
    return "\n".join(lines)


def write_tables(rows: list[dict[str, Any]], spec: CompareSpec, out: Path) -> None:
    """``table.md``, ``table.csv`` and ``table.json`` in ``out``."""
    atomic_write(out / "table.md", markdown(rows, spec).encode())
    buf = io.StringIO()
    keys = [k for k, _, _ in columns_for(rows)]
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out / "table.csv", buf.getvalue().encode())
    doc = {
        "name": spec.name,
        "reference": spec.reference,
        "distances": {"d_e": spec.distances.d_e, "d_c": spec.distances.d_c},
        "columns": {k: h for k, h, _ in columns_for(rows)},
        "rows": rows,
        "relative": _ratios(rows, spec.reference),
    }
    atomic_write(out / "table.json", json.dumps(doc, indent=2).encode())


# -- the plots -------------------------------------------------------------------------------
