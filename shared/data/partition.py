"""Seeded splits of a labelled dataset across devices (DESIGN section 3).

Each function returns one sorted index array per device and draws only from the
``numpy.random.Generator`` it is given. ``label_count_matrix`` gives the (devices x classes)
table every run prints and saves.

:func:`split_dataset`, :func:`split_test` and :func:`device_folder` give the devices their
images: without the public share (``data.public_size``) and each device's seen in its domain
(``data.domains``, :mod:`shared.data.domains`): the domain is applied where a device reads its
data, so every path (simulate, a device agent, a device's own folder) gives device ``i`` the
same images.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared import seeds
from shared.config import DataSection, RunConfig
from shared.data.datasets import ImageDataset, load_dataset, load_image_folder
from shared.data.domains import DOMAINS, apply_domain, device_domain_images, public_split
from shared.errors import ConfigError
from shared.models.presets import check_trainable
from shared.naming import device_name
from shared.progress import progress_bar

Parts = list[np.ndarray]


def iid(labels: np.ndarray, n: int, rng: np.random.Generator) -> Parts:
    """Uniformly shuffled, equal-sized parts."""
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), n)]


def dirichlet(labels: np.ndarray, n: int, beta: float, rng: np.random.Generator) -> Parts:
    """Label skew: each class is split over devices with proportions ~ Dir(beta)."""
    parts: list[list[int]] = [[] for _ in range(n)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet(np.full(n, beta)))[:-1] * len(idx)).astype(int)
        for dev, chunk in enumerate(np.split(idx, cuts)):
            parts[dev].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def classes_per_device(labels: np.ndarray, n: int, k: int, rng: np.random.Generator) -> Parts:
    """Each device holds exactly ``k`` classes (FedPhD: 2); classes are used evenly.

    Class slots are dealt in passes, each pass a fresh seeded permutation of the classes, so
    every class goes to about ``n * k / C`` devices (exactly, when ``C`` divides ``n * k``)
    and the devices holding a class get different partners from pass to pass: a single
    permutation dealt in a cycle would, for ``k = 2`` and an even ``C``, repeat the same
    ``C / 2`` pairs, ``n * k / C`` identical devices each. A device takes the next ``k``
    distinct classes of the deal; a class it already holds waits for the next device.
    Each class's images are split evenly among the devices holding it.
    """
    classes = np.unique(labels)
    if k > len(classes):
        raise ConfigError(f"classes_per_device={k} but the dataset has {len(classes)} classes")
    deal: list[int] = []
    owners: dict[int, list[int]] = {int(c): [] for c in classes}
    for dev in range(n):
        chosen: list[int] = []
        at = 0
        while len(chosen) < k:
            if at == len(deal):  # at most k - 1 classes wait, so a pass always has a new one
                deal.extend(int(c) for c in rng.permutation(classes))
            if deal[at] in chosen:
                at += 1
            else:
                chosen.append(deal.pop(at))
        for c in chosen:
            owners[c].append(dev)
    parts: list[list[int]] = [[] for _ in range(n)]
    for c, devs in owners.items():
        if not devs:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for dev, chunk in zip(devs, np.array_split(idx, len(devs)), strict=True):
            parts[dev].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def shards(labels: np.ndarray, n: int, per_device: int, rng: np.random.Generator) -> Parts:
    """Sort by label, cut into ``n * per_device`` shards, deal ``per_device`` to each (PRISM)."""
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, n * per_device)
    deal = rng.permutation(len(pieces))
    return [
        np.sort(np.concatenate([pieces[j] for j in deal[d * per_device : (d + 1) * per_device]]))
        for d in range(n)
    ]


def quantity(labels: np.ndarray, n: int, sigma: float, rng: np.random.Generator) -> Parts:
    """IID labels, log-normal part sizes (every device gets at least one sample)."""
    weights = rng.lognormal(0.0, sigma, size=n)
    sizes = np.maximum(1, np.floor(weights / weights.sum() * len(labels))).astype(int)
    cuts = np.cumsum(sizes)[:-1]
    cuts = np.minimum(cuts, len(labels))
    return [np.sort(p) for p in np.split(rng.permutation(len(labels)), cuts)]


def dominant(labels: np.ndarray, n: int, uniform: float, rng: np.random.Generator) -> Parts:
    """``uniform`` of each part drawn from all classes, the rest from one dominant class
    (pFedGPA's "s % uniform + dominant classes"; device d's dominant class is d mod C)."""
    classes = np.unique(labels)
    size = len(labels) // n
    pools = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    parts = []
    for d in range(n):
        n_uni = round(size * uniform)
        dom = int(classes[d % len(classes)])
        take: list[int] = []
        uni_classes = rng.choice(classes, size=n_uni)
        for c in [dom] * (size - n_uni) + [int(c) for c in uni_classes]:
            pool = pools[c] or pools[max(pools, key=lambda k: len(pools[k]))]
            if pool:
                take.append(int(pool.pop()))
        parts.append(np.sort(np.asarray(take, dtype=np.int64)))
    return parts


def _even(total: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``total`` split into ``k`` counts differing by at most one (the larger ones at random)."""
    counts = np.full(k, total // k, dtype=np.int64)
    counts[rng.permutation(k)[: total % k]] += 1
    return counts


def dominant_groups(
    labels: np.ndarray,
    n: int,
    groups: Sequence[Sequence[int]],
    uniform: float,
    size: int,
    rng: np.random.Generator,
    *,
    disjoint: bool = True,
) -> Parts:
    """pFedGPA's partition (FedPAC's ``noniid_s``): each device holds ``size`` samples, the
    share ``uniform`` (s) spread evenly over all classes and the rest evenly over the
    dominant classes of its group, ``groups[d mod len(groups)]``. ``disjoint``: no sample
    goes to two devices (training data; a class running out is a ConfigError naming it);
    otherwise each device draws on its own, without repeats within the device (test splits:
    the test set is smaller than the devices' test splits together)."""
    classes = np.unique(labels)
    pools = {int(c): rng.permutation(np.flatnonzero(labels == c)) for c in classes}
    used = dict.fromkeys(pools, 0)
    for g in groups:
        missing = [c for c in g if c not in pools]
        if missing:
            raise ConfigError(f"dominant group {list(g)}: no samples of class {missing[0]}")
    n_uni = round(size * uniform)
    parts = []
    for d in range(n):
        group = [int(c) for c in groups[d % len(groups)]]
        want = dict(zip(pools, _even(n_uni, len(pools), rng).tolist(), strict=True))
        for c, k in zip(group, _even(size - n_uni, len(group), rng).tolist(), strict=True):
            want[c] += k
        take: list[np.ndarray] = []
        for c, k in want.items():
            pool = pools[c]
            if disjoint:
                if used[c] + k > len(pool):
                    raise ConfigError(
                        f"dominant_groups: class {c} has {len(pool)} samples, too few for "
                        f"{n} devices of {size}; use fewer devices or samples_per_device"
                    )
                take.append(pool[used[c] : used[c] + k])
                used[c] += k
            else:
                if k > len(pool):
                    raise ConfigError(f"dominant_groups: class {c} has only {len(pool)} samples")
                take.append(rng.choice(pool, size=k, replace=False))
        parts.append(np.sort(np.concatenate(take).astype(np.int64)))
    return parts


def make_partition(
    labels: np.ndarray, n: int, cfg: DataSection, seed: int, *, test: bool = False
) -> Parts:
    """Partition named by ``cfg.partition``; the same (labels, n, cfg, seed) give the same
    split. ``test``: the devices' test splits of a test set, drawn by the same rule from
    their own RNG stream (``dominant_groups``: ``test_samples_per_device`` each, a test
    image may serve several devices)."""
    if n > len(labels):
        raise ConfigError(f"{n} devices but only {len(labels)} samples")
    rng = seeds.rng("data.split.test" if test else "data.split", seed)
    if cfg.partition == "dominant_groups":
        size = cfg.test_samples_per_device if test else cfg.samples_per_device
        parts = dominant_groups(
            labels, n, cfg.dominant_groups, cfg.dominant_uniform_fraction,
            size or len(labels) // n, rng, disjoint=not test,
        )  # fmt: skip
    elif cfg.partition == "iid":
        parts = iid(labels, n, rng)
    elif cfg.partition == "dirichlet":
        parts = dirichlet(labels, n, cfg.dirichlet_beta, rng)
    elif cfg.partition == "classes":
        parts = classes_per_device(labels, n, cfg.classes_per_device, rng)
    elif cfg.partition == "shards":
        parts = shards(labels, n, cfg.shards_per_device, rng)
    elif cfg.partition == "quantity":
        parts = quantity(labels, n, cfg.quantity_sigma, rng)
    else:
        parts = dominant(labels, n, cfg.dominant_uniform_fraction, rng)
    if cfg.max_samples_per_device and not test:
        parts = [np.sort(rng.permutation(p)[: cfg.max_samples_per_device]) for p in parts]
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:  # a device with no images cannot train (and its update would weigh nothing)
        raise ConfigError(
            f"the {cfg.partition!r} partition leaves {len(empty)} of {n} devices without "
            f"samples (first: device {empty[0]}); use fewer devices, more data, or a milder "
            "skew (e.g. a larger dirichlet_beta)"
        )
    return parts


def label_count_matrix(labels: np.ndarray, parts: Parts, num_classes: int) -> np.ndarray:
    """(devices x classes) int matrix of label counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts]).astype(np.int64)


def format_label_counts(matrix: np.ndarray, names: list[str] | None = None) -> str:
    """Fixed-width table of a label-count matrix with row and column totals."""
    rows = names or [f"dev{i}" for i in range(matrix.shape[0])]
    width = max(6, len(str(int(matrix.max(initial=0)))) + 1)
    head = "device".ljust(10) + "".join(f"{c:>{width}}" for c in range(matrix.shape[1]))
    lines = [head + "   total"]
    for name, row in zip(rows, matrix, strict=True):
        lines.append(name.ljust(10) + "".join(f"{v:>{width}}" for v in row) + f"{row.sum():>8}")
    lines.append(
        "total".ljust(10) + "".join(f"{v:>{width}}" for v in matrix.sum(0)) + f"{matrix.sum():>8}"
    )
    return "\n".join(lines)


def in_domains(
    data: ImageDataset, parts: Parts, domains: Sequence[str], seed: int, *, test: bool = False
) -> tuple[ImageDataset, Parts]:
    """``data`` with device ``i``'s part seen in its domain
    (:func:`~shared.data.domains.device_domain_images` of ``data.images[parts[i]]``; the
    noise from the test split's stream with ``test``). Disjoint parts (every training split)
    keep their indices: their rows are replaced in a copy, rows of no part stay as they are.
    Overlapping parts (``dominant_groups``' test splits: an image may serve several devices,
    each in its own domain) each become a copy of their own, concatenated in device order,
    and the parts index into that. ``data`` and ``parts`` as they are for no domains."""
    if not domains:
        return data, parts
    flat = np.concatenate(parts)
    if len(np.unique(flat)) == len(flat):
        images = data.images.copy()
        for i, p in enumerate(parts):
            images[p] = device_domain_images(data.images[p], domains, i, seed, test=test)
        return ImageDataset(images, data.labels, data.name, data.skipped), parts
    seen = [
        device_domain_images(data.images[p], domains, i, seed, test=test)
        for i, p in enumerate(parts)
    ]
    cuts = np.cumsum([0] + [len(p) for p in parts])
    return (
        ImageDataset(np.concatenate(seen), data.labels[flat], data.name, data.skipped),
        [np.arange(a, b) for a, b in itertools.pairwise(cuts)],
    )


def split_dataset(
    cfg: RunConfig, *, progress: bool = False, domains: bool = True
) -> tuple[ImageDataset, Parts]:
    """``cfg``'s training images and which of them each of ``federation.num_devices`` devices
    holds: the seeded split of the config's dataset (an image folder at ``data.path`` too),
    or with ``data.dataset = "folder"`` and no path the devices' own folders
    ``data.local_dir/<device id>`` one after another (the layout
    ``estuary split-data`` writes; ``progress``: a bar over the folders). Refused for a preset
    the configured data cannot train (:func:`shared.models.presets.check_trainable`). The
    split draws on the labels only, whatever the images' channels.

    A loaded dataset loses its public share first (``data.public_size``,
    :func:`~shared.data.domains.public_split`): the returned dataset is the rest, which the
    parts index into, so no device holds a public image (own folders have no public share).
    With ``data.domains`` and ``domains`` (False: the images as stored, what
    ``estuary split-data`` writes), device ``i``'s images are seen in its domain
    (:func:`in_domains`; the noise seeded by ``run.seed`` and ``i``)."""
    check_trainable(cfg)
    d = cfg.data
    if d.own_folders:
        if not d.local_dir:
            raise ConfigError(
                "data.dataset = 'folder' in one process (simulate, compare): set data.local_dir "
                "to the directory holding one image folder per device (dev000, dev001, ...; "
                "`estuary split-data` writes that layout), or data.path to one image folder "
                "to split across the devices"
            )
        devices = progress_bar(
            range(cfg.federation.num_devices), desc="reading device folders", unit="dev",
            disable=not progress,
        )  # fmt: skip
        shares = [
            device_folder(cfg, i, Path(d.local_dir) / device_name(i), domains=domains)
            for i in devices
        ]
        cuts = np.cumsum([0] + [len(s) for s in shares])
        data = ImageDataset(
            np.concatenate([s.images for s in shares]),
            np.concatenate([s.labels for s in shares]),
            f"folders:{d.local_dir}",
            sum(s.skipped for s in shares),
        )
        return data, [np.arange(a, b) for a, b in itertools.pairwise(cuts)]
    data = load_dataset(
        d.dataset, d.path, size=d.synthetic_size, seed=cfg.run.seed, class_names=d.class_names
    )
    if d.public_size:
        data = data.subset(public_split(len(data), d.public_size)[1])
    parts = make_partition(data.labels, cfg.federation.num_devices, d, cfg.run.seed)
    return in_domains(data, parts, d.domains if domains else [], cfg.run.seed)


def split_test(cfg: RunConfig) -> tuple[ImageDataset, Parts] | None:
    """The devices' own test splits (classifiers report their accuracy on them): the
    dataset's test set split by the training split's rule (:func:`make_partition` with
    ``test``), each device's seen in its domain (:func:`in_domains` with ``test``: the noise
    drawn from a stream of its own, not the training images'; the parts may then index into
    per-device copies). The whole test set, whatever ``data.public_size``. None for image
    folders, which have no test set."""
    d = cfg.data
    if d.dataset == "folder":
        return None
    data = load_dataset(
        d.dataset, d.path, split="test", size=d.synthetic_size, seed=cfg.run.seed,
        class_names=d.class_names,
    )  # fmt: skip
    n = cfg.federation.num_devices
    parts = make_partition(data.labels, n, d, cfg.run.seed, test=True)
    return in_domains(data, parts, d.domains, cfg.run.seed, test=True)


def domain_test_sets(cfg: RunConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The whole test set seen in each domain of ``data.domains`` (in order of first
    appearance; ``identity`` alone without domains): domain -> (uint8 images, int64 labels),
    on which the cloud reports accuracy per domain. A domain's noise is drawn from a stream
    of (``run.seed``, the domain), not a device's. Empty for image folders, which have no
    test set."""
    d = cfg.data
    if d.dataset == "folder":
        return {}
    data = load_dataset(
        d.dataset, d.path, split="test", size=d.synthetic_size, seed=cfg.run.seed,
        class_names=d.class_names,
    )  # fmt: skip
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in dict.fromkeys(d.domains or ["identity"]):
        rng = np.random.default_rng(
            seeds.sequence("data.domain", cfg.run.seed, domain=DOMAINS.index(name))
        )
        out[name] = apply_domain(data.images, name, rng), data.labels
    return out


def device_folder(
    cfg: RunConfig, index: int, folder: Path, *, progress: bool = False, domains: bool = True
) -> ImageDataset:
    """Device ``index``'s own images from ``folder`` (at most
    ``data.max_samples_per_device``, drawn with the run's seed and the index), seen in its
    domain (``data.domains`` and ``domains``; the noise seeded as :func:`split_dataset`
    seeds device ``index``'s, so a folder ``estuary split-data`` wrote gives the images the
    split gives)."""
    check_trainable(cfg)
    share = load_image_folder(
        folder,
        class_names=cfg.data.class_names,
        max_images=cfg.data.max_samples_per_device,
        seed=seeds.integer("data.folder", cfg.run.seed, device=index),
        progress=progress,
    )
    if not (domains and cfg.data.domains):
        return share
    images = device_domain_images(share.images, cfg.data.domains, index, cfg.run.seed)
    return ImageDataset(images, share.labels, share.name, share.skipped)
