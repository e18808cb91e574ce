"""Sample-quality metrics for Fashion-MNIST generators: FID, IS, precision/recall, density/coverage.

The usual metrics are defined on ImageNet Inception-v3 features, which cannot be downloaded
here (and are a poor fit for 28x28 greyscale clothes anyway). Instead every metric is computed
on the features of :class:`FeatureNet`, a small CNN we train ourselves on the Fashion-MNIST
train split (``python scripts/train_feature_classifier.py``) and ship as
``shared/assets/fmnist_features.safetensors``. Numbers are therefore comparable between runs
that use the same extractor (:data:`EXTRACTOR_NAME` plus :data:`FEATURE_WEIGHTS_SHA256`), but
**not** with FIDs published for Inception features.

Input images are float tensors ``(N, 1, 32, 32)`` in [-1, 1], the space of
:func:`shared.data.datasets.to_model_input` and of the diffusion models' samples. Samples of a
3-channel model trained on the gray view of a grayscale dataset (``data.gray_to_rgb``) are
brought to one channel by :func:`one_channel` (the mean of the channels) first.

Typical use, evaluating every few rounds against a reference computed once::

    ref = reference_stats(to_model_input(load_fashion_mnist("test").images))
    metrics = evaluate(samples, ref)   # {"fid": ..., "precision": ..., ...}

FID depends on the number of samples (it is biased upwards for small N): compare values
only at equal ``n_fake`` / ``n_real``.

Invalid inputs (wrong shapes, NaNs, too few samples) raise :class:`shared.errors.DataError`;
a missing or tampered weights file raises :class:`shared.errors.CodecError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy import linalg
from scipy.special import xlogy
from torch import nn

from shared.errors import CodecError, DataError
from shared.models.assets import load_shipped_net

EXTRACTOR_NAME = "fmnist-cnn-v1"
FEATURE_DIM = 128
NUM_CLASSES = 10
DEFAULT_WEIGHTS = Path(__file__).resolve().parents[1] / "assets" / "fmnist_features.safetensors"
FEATURE_WEIGHTS_SHA256 = "eae95f2da038669f14477f3ef8051f5bc8f5ff2cf9e5f622086b080829695afb"
RETRAIN_HINT = "Retrain it with `python scripts/train_feature_classifier.py`"
_DIST_CHUNK = 512  # rows per block of a distance matrix (512 x 10k float64 = 40 MB)


# --------------------------------------------------------------------------------------------
# Feature extractor
# --------------------------------------------------------------------------------------------


class FeatureNet(nn.Module):
    """Small Fashion-MNIST classifier whose penultimate layer serves as the feature space.

    Architecture (input ``(N, 1, 32, 32)`` in [-1, 1]; the whole 32x32 frame is seen, so
    artefacts in the padding border of generated images count too)::

        3 x [conv3x3 -> BatchNorm -> ReLU -> maxpool2]   widths 16, 32, 64   -> (N, 64, 4, 4)
        flatten -> Linear(1024, 128) -> ReLU                                  -> features (N, 128)
        Linear(128, 10)                                                       -> logits

    :meth:`features` returns the 128-d post-ReLU embedding (non-negative, like Inception's
    pool3 features); :meth:`forward` returns the class logits.
    """

    widths = (16, 32, 64)

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 1
        for c_out in self.widths:
            layers += [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            c_in = c_out
        self.conv = nn.Sequential(*layers)
        self.embed = nn.Linear(c_in * 4 * 4, FEATURE_DIM)
        self.head = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def init_weights(self, generator: torch.Generator) -> None:
        """Re-initialise every weight from ``generator`` (Kaiming for conv/linear layers)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate embedding ``(N, 128)`` (after ReLU) of images ``(N, 1, 32, 32)``."""
        h = self.conv(x).flatten(1)
        return torch.relu(self.embed(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(N, 10)`` of images ``(N, 1, 32, 32)`` in [-1, 1]."""
        return self.head(self.features(x))


def load_feature_extractor(
    path: str | Path | None = None, *, expected_sha256: str = FEATURE_WEIGHTS_SHA256
) -> FeatureNet:
    """Load the shipped :class:`FeatureNet` (eval mode, gradients off) after checking its hash.

    The file's sha256 is checked on every call (cheap, ~0.6 MB); the model itself is built
    once per (path, hash) and cached, so callers share one instance: do not modify it.

    Raises:
        CodecError: the file is missing, its sha256 differs from ``expected_sha256``, or it
            does not hold exactly FeatureNet's tensors.
    """
    return load_shipped_net(
        FeatureNet, Path(path) if path is not None else DEFAULT_WEIGHTS, expected_sha256,
        name=EXTRACTOR_NAME, hint=RETRAIN_HINT,
        constant="FEATURE_WEIGHTS_SHA256 in shared/evaluation/quality.py",
    )  # fmt: skip


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor):
        raise DataError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.ndim != 4 or tuple(images.shape[1:]) != (1, 32, 32):
        raise DataError(
            f"images must be (N, 1, 32, 32) in [-1, 1] (see shared.data.datasets.to_model_input), "
            f"got {tuple(images.shape)}"
        )
    if not images.is_floating_point():
        raise DataError(f"images must be floating point in [-1, 1], got {images.dtype}")


def one_channel(images: torch.Tensor) -> torch.Tensor:
    """Images ``(N, 3, H, W)`` of the gray view as float32 ``(N, 1, H, W)``: the mean of the
    three channels, taken in float64 so that three equal float32 channels (the view
    replicates the gray image) give that image exactly; 1-channel images are returned as
    they are."""
    if images.ndim == 4 and images.shape[1] == 3:
        return images.double().mean(dim=1, keepdim=True).float()
    return images


def extract(
    images: torch.Tensor, batch_size: int = 500, *, model: FeatureNet | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features and class probabilities of images ``(N, 1, 32, 32)`` in [-1, 1].

    Images are clamped to [-1, 1] (as when they are saved) and run through the extractor in
    eval mode under ``torch.no_grad`` in batches of ``batch_size`` on the CPU.

    Returns:
        ``(features, probs)``: float64 arrays ``(N, 128)`` and ``(N, 10)`` (softmax).

    Raises:
        DataError: wrong shape or dtype, or non-finite pixels.
    """
    _check_images(images)
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    net = model if model is not None else load_feature_extractor()
    was_training = net.training
    net.eval()
    feats, probs = [], []
    try:
        with torch.no_grad():
            for start in range(0, images.shape[0], batch_size):
                x = images[start : start + batch_size].detach().to("cpu", torch.float32)
                if not torch.isfinite(x).all():
                    raise DataError("images hold NaN or infinite pixels")
                f = net.features(x.clamp(-1.0, 1.0))
                feats.append(f.double().numpy())
                probs.append(torch.softmax(net.head(f).double(), dim=1).numpy())
    finally:
        net.train(was_training)
    if not feats:
        return np.zeros((0, FEATURE_DIM)), np.zeros((0, NUM_CLASSES))
    return np.concatenate(feats), np.concatenate(probs)


# --------------------------------------------------------------------------------------------
# Metrics on features
# --------------------------------------------------------------------------------------------


def _as_features(x: np.ndarray, name: str, min_rows: int = 2) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise DataError(f"{name} must be a 2-D array (N, D), got shape {a.shape}")
    if a.shape[0] < min_rows:
        raise DataError(f"{name} needs at least {min_rows} samples, got {a.shape[0]}")
    if not np.isfinite(a).all():
        raise DataError(f"{name} holds NaN or infinite values")
    return a


def gaussian_stats(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``(D,)`` and unbiased covariance ``(D, D)`` of features ``(N, D)``."""
    a = _as_features(feats, "features")
    return a.mean(axis=0), np.atleast_2d(np.cov(a, rowvar=False))


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, eps: float = 1e-6
) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2).

    ``||mu1 - mu2||^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^{1/2})`` (Dowson & Landau 1982;
    Heusel et al. 2017, "GANs Trained by a Two Time-Scale Update Rule Converge to a Local Nash
    Equilibrium"). The matrix square root uses :func:`scipy.linalg.sqrtm`; when it is not
    finite or scipy reports a singular matrix (near-singular covariances, e.g. dead ReLU
    units), ``eps`` is added to both diagonals; a negligible imaginary part from round-off is
    dropped, as in pytorch-fid.
    """
    mu1 = np.atleast_1d(np.asarray(mu1, np.float64))
    mu2 = np.atleast_1d(np.asarray(mu2, np.float64))
    s1 = np.atleast_2d(np.asarray(sigma1, np.float64))
    s2 = np.atleast_2d(np.asarray(sigma2, np.float64))
    d = mu1.shape[0]
    if mu2.shape != (d,) or s1.shape != (d, d) or s2.shape != (d, d):
        raise DataError(
            f"Gaussian statistics disagree: mu {mu1.shape} / {mu2.shape}, "
            f"sigma {s1.shape} / {s2.shape}"
        )
    diff = mu1 - mu2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", linalg.LinAlgWarning)
            covmean = linalg.sqrtm(s1 @ s2)
        singular = not np.isfinite(covmean).all()
    except linalg.LinAlgWarning:
        singular = True
    if singular:  # distance between the regularised Gaussians (traces included: no eps bias)
        s1, s2 = s1 + np.eye(d) * eps, s2 + np.eye(d) * eps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", linalg.LinAlgWarning)
            covmean = linalg.sqrtm(s1 @ s2)
    if np.iscomplexobj(covmean):
        imag = np.abs(np.diagonal(covmean).imag).max()
        scale = max(1.0, float(np.abs(np.trace(covmean))))
        if imag > 1e-3 * scale:
            raise DataError(f"covariance square root has a large imaginary part ({imag:.3g})")
        covmean = covmean.real
    value = float(diff @ diff + np.trace(s1) + np.trace(s2) - 2.0 * np.trace(covmean))
    return max(value, 0.0)


def fid(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Fréchet Inception Distance between two feature sets ``(N, D)`` and ``(M, D)``.

    Heusel et al. 2017, "GANs Trained by a Two Time-Scale Update Rule Converge to a Local Nash
    Equilibrium" (NeurIPS), computed here on :class:`FeatureNet` features. Each set is
    summarised by its mean and covariance; see :func:`frechet_distance`. 0 for identical sets.
    """
    mu_a, sig_a = gaussian_stats(feats_a)
    mu_b, sig_b = gaussian_stats(feats_b)
    return frechet_distance(mu_a, sig_a, mu_b, sig_b)


def inception_score(probs: np.ndarray, splits: int = 10) -> tuple[float, float]:
    """Inception Score ``exp(E_x KL(p(y|x) || p(y)))``, mean and std over ``splits`` chunks.

    Salimans et al. 2016, "Improved Techniques for Training GANs" (NeurIPS). Ranges from 1
    (every sample has the same class distribution) to the number of classes (confident and
    uniformly spread predictions). Samples are split in order with :func:`numpy.array_split`.
    """
    p = _as_features(probs, "probs", min_rows=1)
    if splits < 1 or splits > p.shape[0]:
        raise DataError(f"splits must be in [1, {p.shape[0]}] for {p.shape[0]} samples: {splits}")
    if (p < 0).any() or not np.allclose(p.sum(axis=1), 1.0, atol=1e-6):
        raise DataError("probs rows must be probability distributions (non-negative, summing to 1)")
    scores = []
    for part in np.array_split(p, splits):
        py = part.mean(axis=0, keepdims=True)
        kl = (xlogy(part, part) - xlogy(part, py)).sum(axis=1).mean()
        scores.append(float(np.exp(kl)))
    return float(np.mean(scores)), float(np.std(scores))


def _sq_norms(x: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", x, x)


def _sq_dists(a: np.ndarray, b: np.ndarray, b_sq: np.ndarray) -> np.ndarray:
    """Squared Euclidean distances ``(len(a), len(b))``, clipped at 0."""
    d = _sq_norms(a)[:, None] + b_sq[None, :] - 2.0 * (a @ b.T)
    np.maximum(d, 0.0, out=d)
    return d


def knn_radii(x: np.ndarray, ks: Iterable[int]) -> dict[int, np.ndarray]:
    """Squared distance from each row of ``x`` to its k-th nearest *other* row, for each k.

    Distances are computed in blocks of rows, so memory stays at ``O(block * N)``.
    """
    a = _as_features(x, "features")
    ks = sorted(set(ks))
    n = a.shape[0]
    if not ks or ks[0] < 1 or ks[-1] >= n:
        raise DataError(f"k must be in [1, {n - 1}] for {n} samples, got {ks}")
    a_sq = _sq_norms(a)
    out = {k: np.empty(n) for k in ks}
    for start in range(0, n, _DIST_CHUNK):
        d = _sq_dists(a[start : start + _DIST_CHUNK], a, a_sq)
        rows = np.arange(d.shape[0])
        d[rows, rows + start] = 0.0  # self-distance exactly 0, so index k is the k-th neighbour
        part = np.partition(d, ks, axis=1)
        for k in ks:
            out[k][start : start + d.shape[0]] = part[:, k]
    return out


@dataclass(frozen=True)
class _Manifold:
    precision: float
    recall: float
    density: float
    coverage: float


def _manifold_metrics(
    real: np.ndarray,
    fake: np.ndarray,
    real_radii_pr: np.ndarray,
    fake_radii_pr: np.ndarray,
    real_radii_dc: np.ndarray,
    k_dc: int,
) -> _Manifold:
    """One blocked pass over real x fake distances computing all four k-NN metrics.

    Radii are squared k-NN distances; a point is inside a ball when its squared distance to
    the centre is ``<=`` the ball's squared radius.
    """
    fake_sq = _sq_norms(fake)
    fake_in_real = np.zeros(fake.shape[0], dtype=bool)  # precision
    real_in_fake = np.zeros(real.shape[0], dtype=bool)  # recall
    density_count = np.zeros(fake.shape[0], dtype=np.int64)
    covered = np.zeros(real.shape[0], dtype=bool)
    for start in range(0, real.shape[0], _DIST_CHUNK):
        stop = start + _DIST_CHUNK
        d = _sq_dists(real[start:stop], fake, fake_sq)  # (block of real, all fake)
        fake_in_real |= (d <= real_radii_pr[start:stop, None]).any(axis=0)
        real_in_fake[start:stop] = (d <= fake_radii_pr[None, :]).any(axis=1)
        inside_dc = d <= real_radii_dc[start:stop, None]
        density_count += inside_dc.sum(axis=0)
        covered[start:stop] = inside_dc.any(axis=1)
    return _Manifold(
        precision=float(fake_in_real.mean()),
        recall=float(real_in_fake.mean()),
        density=float(density_count.sum() / (k_dc * fake.shape[0])),
        coverage=float(covered.mean()),
    )


def _pair(real: np.ndarray, fake: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r, f = _as_features(real, "real features"), _as_features(fake, "fake features")
    if r.shape[1] != f.shape[1]:
        raise DataError(f"feature dimensions differ: real {r.shape[1]}, fake {f.shape[1]}")
    return r, f


def precision_recall(real: np.ndarray, fake: np.ndarray, k: int = 3) -> tuple[float, float]:
    """Improved precision and recall of a generative model (k-NN manifold estimate).

    Kynkäänniemi et al. 2019, "Improved Precision and Recall Metric for Assessing Generative
    Models" (NeurIPS). Each sample gets a ball reaching its k-th nearest neighbour within its
    own set; precision is the fraction of fake samples inside some real ball, recall the
    fraction of real samples inside some fake ball.
    """
    r, f = _pair(real, fake)
    r_radii = knn_radii(r, [k])[k]
    f_radii = knn_radii(f, [k])[k]
    m = _manifold_metrics(r, f, r_radii, f_radii, r_radii, k)
    return m.precision, m.recall


def density_coverage(real: np.ndarray, fake: np.ndarray, k: int = 5) -> tuple[float, float]:
    """Density and coverage (k-NN balls around real samples only).

    Naeem et al. 2020, "Reliable Fidelity and Diversity Metrics for Generative Models" (ICML).
    Density is the mean number of real k-NN balls containing each fake sample, divided by k
    (about 1 when the distributions match, can exceed 1); coverage is the fraction of real
    samples whose ball contains at least one fake sample.
    """
    r, f = _pair(real, fake)
    r_radii = knn_radii(r, [k])[k]
    dummy = np.zeros(f.shape[0])
    m = _manifold_metrics(r, f, r_radii, dummy, r_radii, k)
    return m.density, m.coverage


# --------------------------------------------------------------------------------------------
# Reference statistics and the one-call evaluation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ReferenceStats:
    """Cached features of a real (reference) image set, reusable across evaluations.

    Holds the features, their Gaussian statistics (for FID) and squared k-NN radii for the
    ``ks`` used by precision/recall and density/coverage, tagged with the extractor that made
    them so stale statistics are refused.
    """

    features: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray
    radii: dict[int, np.ndarray] = field(repr=False)
    extractor: str = EXTRACTOR_NAME
    weights_sha256: str = FEATURE_WEIGHTS_SHA256

    @property
    def n(self) -> int:
        """Number of reference samples."""
        return int(self.features.shape[0])

    @classmethod
    def from_features(cls, feats: np.ndarray, ks: Iterable[int] = (3, 5)) -> ReferenceStats:
        """Statistics of already-extracted features ``(N, D)``."""
        a = _as_features(feats, "reference features")
        mu, sigma = gaussian_stats(a)
        return cls(features=a, mu=mu, sigma=sigma, radii=knn_radii(a, ks))

    def radius(self, k: int) -> np.ndarray:
        """Squared k-NN radii, computed (not cached: the object is frozen) if not precomputed."""
        return self.radii[k] if k in self.radii else knn_radii(self.features, [k])[k]

    def save(self, path: str | Path) -> None:
        """Write to ``.npz`` (no pickle), atomically."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp.npz")
        arrays: dict[str, np.ndarray] = {f"radius_{k}": v for k, v in self.radii.items()}
        arrays.update(
            features=self.features, mu=self.mu, sigma=self.sigma,
            extractor=np.array(self.extractor), weights_sha256=np.array(self.weights_sha256),
        )  # fmt: skip
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> ReferenceStats:
        """Read a file written by :meth:`save`; refuses one made by another extractor."""
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {name: z[name] for name in z.files}
        except (OSError, ValueError, KeyError) as err:
            raise CodecError(f"cannot read reference stats {path}: {err}") from None
        try:
            extractor, sha = str(data["extractor"]), str(data["weights_sha256"])
            stats = cls(
                features=data["features"], mu=data["mu"], sigma=data["sigma"],
                radii={int(n[7:]): v for n, v in data.items() if n.startswith("radius_")},
                extractor=extractor, weights_sha256=sha,
            )  # fmt: skip
        except KeyError as err:
            raise CodecError(f"reference stats {path} lack {err}") from None
        if (extractor, sha) != (EXTRACTOR_NAME, FEATURE_WEIGHTS_SHA256):
            raise CodecError(
                f"reference stats {path} were made with {extractor} ({sha[:12]}), not "
                f"{EXTRACTOR_NAME} ({FEATURE_WEIGHTS_SHA256[:12]}); recompute them"
            )
        return stats


def reference_stats(
    images: torch.Tensor, *, ks: Iterable[int] = (3, 5), batch_size: int = 500
) -> ReferenceStats:
    """Extract features of real images ``(N, 1, 32, 32)`` once, for repeated :func:`evaluate`."""
    feats, _ = extract(images, batch_size)
    return ReferenceStats.from_features(feats, ks)


def evaluate(
    fake: torch.Tensor,
    real: torch.Tensor | ReferenceStats,
    *,
    k_pr: int = 3,
    k_dc: int = 5,
    splits: int = 10,
    batch_size: int = 500,
) -> dict[str, float | int | str]:
    """All metrics of generated images against real images (or cached :class:`ReferenceStats`).

    Returns ``{"extractor", "fid", "is_mean", "is_std", "precision", "recall", "density",
    "coverage", "n_fake", "n_real"}``. IS uses ``min(splits, n_fake)`` splits. FID is biased
    by sample size: compare runs at equal ``n_fake`` and ``n_real``. Needs more than
    ``max(k_pr, k_dc)`` samples in each set.
    """
    if isinstance(real, ReferenceStats):
        ref = real
    else:
        ref = reference_stats(real, ks=(k_pr, k_dc), batch_size=batch_size)
    if (ref.extractor, ref.weights_sha256) != (EXTRACTOR_NAME, FEATURE_WEIGHTS_SHA256):
        raise DataError(f"reference stats were made with another extractor ({ref.extractor})")
    f_feats, f_probs = extract(fake, batch_size)
    r_feats = ref.features
    if f_feats.shape[0] <= max(k_pr, k_dc):
        raise DataError(f"need more than {max(k_pr, k_dc)} fake samples, got {f_feats.shape[0]}")
    mu_f, sigma_f = gaussian_stats(f_feats)
    is_mean, is_std = inception_score(f_probs, splits=min(splits, f_feats.shape[0]))
    m = _manifold_metrics(
        r_feats, f_feats, ref.radius(k_pr), knn_radii(f_feats, [k_pr])[k_pr], ref.radius(k_dc), k_dc
    )
    return {
        "extractor": EXTRACTOR_NAME,
        "fid": frechet_distance(ref.mu, ref.sigma, mu_f, sigma_f),
        "is_mean": is_mean,
        "is_std": is_std,
        "precision": m.precision,
        "recall": m.recall,
        "density": m.density,
        "coverage": m.coverage,
        "n_fake": int(f_feats.shape[0]),
        "n_real": ref.n,
    }
