"""``estuary compare``: several methods on the same data split and seed, one table, two plots.

The config is TOML: a base run config and a list of methods, each a label plus overrides::

    [compare]
    name = "my-compare"    # default: the file's stem (and runs/<name> without --out)
    reference = "FedAvg"   # ratios and the equal-compute window (default: first federated)
    d_e = 1.0              # distances of the weighted cost (FedPhD: d_c = 10 d_e)
    d_c = 10.0

    [base.run]             # any run config (or: base = "configs/some_run.toml")
    seed = 0
    ...

    [[method]]
    label = "FedPhD"
    overrides = {"algorithm.name" = "fedphd", "federation.cloud_every" = 5}

    [[method]]
    label = "Centralized"
    centralized = true     # one model on the pooled data of all devices, same local steps
    ema = 0.999            # optional: evaluate an average of its weights (the paper's
                           # centralized baseline uses EMA; its federated methods do not)

    [[method]]
    label = "Centralized (s_p=0.44)"
    centralized = true     # the ceiling of a pruned architecture: pruned once at init
    overrides = {"algorithm.name" = "fedphd", "algorithm.fedphd.prune_ratio" = 0.44,
                 "algorithm.fedphd.prune_at" = "init"}

Overrides are dotted ``section.key`` names (an ``[method.overrides]`` sub-table, or nested
tables, work too); an unknown section or key is a :class:`ConfigError` naming it.

``ESTUARY__SECTION__KEY`` environment overrides apply to the base; a method's overrides win.
Methods may not change the split (``data.*``, ``federation.num_devices``, ``run.seed``); they
may change anything else (``model.*``, ``train.*``, ``algorithm.*``, ``run.rounds``: one-shot
FedDEO runs one round beside a 20-round FedAvg).

A centralized method of a classifier preset trains it with cross-entropy on the pooled
images and labels of every device (each seen in its domain), ``train.local_epochs`` passes a
round for ``run.rounds`` rounds, and is scored on the whole test set seen in every domain
(``data.domains``). When runs report such per-domain accuracy (their ``final``: FedDEO's
product, a classifier's final global model under ``data.domains``, a centralized classifier)
the table is FedDEO's instead (:mod:`estuary.compare.tables`): a column per domain, the mean,
rounds, the bytes one device uploaded and fetched over the whole run and its upload over the
reference's, with ``accuracy_by_domain.png``.
The output directory gets one run directory per method, ``table.md``/``.csv``/``.json``
(:mod:`shared.metrics.accounting` defines every byte and cost column) and ``quality.png`` /
``bytes.png``. Rounds differ in length between methods (FedAvg with E = 5 trains five times
longer per round than E = 1), so both plots put total local steps (all devices) on the x axis.

A finished method leaves ``<slug>/method.json`` (its rows, traffic, plan and timing, keyed by
the config digest and the content hash of the ``model.init`` file). Running the same
comparison into the same directory again reuses every method whose record matches and runs
the rest, so a long comparison that was interrupted (or split over several time-limited
sessions) picks up where it stopped. A federated method that was interrupted part-way goes on
after its latest checkpoint, with its devices' kept state (:mod:`estuary.resume`), and ends on
the same model as an uninterrupted run; one whose checkpoints are of another config starts
over, said once; a centralized ceiling (checkpointed only at its end) starts over.
``fresh=True`` (``--fresh``) runs everything again from the first round. A record that does
not parse or belongs to another config is ignored with the reason printed, and that method
runs.

``only`` (``--only LABEL``, repeatable) runs just those methods; the others are reused where
they have a record, and the tables and plots are written once every method has one (until
then the missing ones are named). ``jobs`` (``--jobs N``) runs up to N methods at once, each
in its own ``estuary compare --only`` process with ``1/N`` of the CPUs it may use (unless
``train.threads`` says otherwise) and its output in ``<slug>/compare.log``; the parent reads
back their records, so a method that fails leaves the others' records for the next run.
"""

from estuary.compare.record import load_record, save_record
from estuary.compare.runner import run_centralized, run_compare, run_method
from estuary.compare.spec import (
    CompareResult,
    CompareSpec,
    Method,
    MethodRun,
    load_compare,
    parse_compare,
    steps_per_round,
)
from estuary.compare.tables import summarize

__all__ = [
    "CompareResult",
    "CompareSpec",
    "Method",
    "MethodRun",
    "load_compare",
    "load_record",
    "parse_compare",
    "run_centralized",
    "run_compare",
    "run_method",
    "save_record",
    "steps_per_round",
    "summarize",
]
