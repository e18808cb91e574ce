"""FedAdam and FedYogi (Reddi et al., ICLR 2021, "Adaptive Federated Optimization",
Algorithm 2) on a two-tier hierarchy.

Devices train as FedAvg's do (the DDPM loss, or cross-entropy for a classifier) and upload
their model; the edges average them by sample counts. The cloud averages the edges' models
the same way (``avg``) and, instead of adopting the average, treats
``Delta = avg - x`` (``x``: the global model the round started from) as a pseudo-gradient:

    m = beta1 m + (1 - beta1) Delta
    v = beta2 v + (1 - beta2) Delta^2                       (FedAdam)
    v = v - (1 - beta2) Delta^2 sign(v - Delta^2)           (FedYogi)
    x = x + eta m / (sqrt(v) + tau)

with ``m`` starting at 0 and ``v`` at ``tau^2`` (Algorithm 2 line 1: ``v_{-1} >= tau^2``),
no bias correction (as in the paper), element-wise over every floating-point tensor of the
model, in float64; integer buffers take the average. The average weighs devices by their
samples (FedAvg's rule; the paper's plain mean over the round's clients where the samples
are equal).

The moments are the cloud's own: they never travel; the cloud keeps them beside each
checkpoint (``fedadam/moments.safetensors``, written atomically) and takes them back when it
resumes, so a restarted run continues with the same moments.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from shared.atomic import atomic_write
from shared.config import RunConfig
from shared.errors import CodecError
from shared.methods.aggregation import MeanFold
from shared.methods.api import Fold, TensorDict, Update
from shared.methods.baselines.fedavg import FedAvg
from shared.methods.fedadam.config import FedAdamConfig
from shared.settings import AlgorithmConfig
from shared.wire.codec import decode_tensors, encode_tensors, read_metadata

log = logging.getLogger(__name__)

#: the folder of the cloud's moments, beside its checkpoints
STATE_DIR = "fedadam"
MOMENTS_FILE = "moments.safetensors"


def server_step(
    current: Mapping[str, torch.Tensor],
    average: Mapping[str, torch.Tensor],
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]],
    settings: FedAdamConfig,
) -> TensorDict:
    """One step of the server's optimizer (module docstring): the new global model from the
    model the round started from and the average of the edges' models; ``moments`` (name ->
    (m, v), float64) are updated in place, created where missing."""
    s = settings
    out: TensorDict = {}
    for name, avg in average.items():
        x = current[name]
        if not avg.is_floating_point():
            out[name] = avg.clone()  # integer buffers (counters) take the average
            continue
        delta = avg.double() - x.double()
        m, v = moments.get(name) or (
            torch.zeros(delta.shape, dtype=torch.float64),
            torch.full(delta.shape, s.tau**2, dtype=torch.float64),
        )
        m = s.beta1 * m + (1.0 - s.beta1) * delta
        sq = delta.square()
        if s.variant == "yogi":
            v = v - (1.0 - s.beta2) * sq * torch.sign(v - sq)
        else:
            v = s.beta2 * v + (1.0 - s.beta2) * sq
        moments[name] = (m, v)
        out[name] = (x.double() + s.eta * m / (v.sqrt() + s.tau)).to(avg.dtype)
    return out


class ServerStepFold(Fold):
    """The cloud's fold: the edges' sample-weighted mean, streamed as FedAvg's, then one
    step of the server's optimizer from the round's global model."""

    def __init__(self, method: FedAdam, current: TensorDict) -> None:
        super().__init__()
        self.method, self.current = method, current
        self.mean = MeanFold()

    def _add(self, update: Update) -> None:
        self.mean.add(update)

    def result(self) -> TensorDict:
        return server_step(self.current, self.mean.result(), self.method.moments,
                           self.method.settings)  # fmt: skip


class FedAdam(FedAvg):
    """FedAvg on the devices and the edges; Adam (or Yogi) on the cloud."""

    name = "fedadam"
    config_class: ClassVar[type[AlgorithmConfig]] = FedAdamConfig
    settings: FedAdamConfig
    #: the cloud's moments are files beside its checkpoints
    keeps_files = True
    #: the cloud's step reads the global model it started from
    aggregation_stateless = False

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.state_view = self
        #: the cloud's moments (m, v) per model tensor, float64 (empty before the first step)
        self.moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def cloud_fold(self, current: TensorDict) -> Fold:
        """The edges' mean, then the server optimizer's step."""
        return ServerStepFold(self, current)

    # -- the cloud's own file (beside its checkpoints; never exported or published) ------
    def origin(self) -> str | None:
        """Nothing but ``model.init``."""
        return None

    def card_entry(self, module: nn.Module) -> dict[str, Any]:
        """The server optimizer's settings."""
        s = self.settings
        return {"variant": s.variant, "eta": s.eta, "beta1": s.beta1, "beta2": s.beta2,
                "tau": s.tau}  # fmt: skip

    def save_cloud_state(self, directory: Path, round_: int) -> None:
        """``fedadam/moments.safetensors``: ``m/<name>`` and ``v/<name>`` after round
        ``round_`` (float64), written atomically."""
        folder = directory / STATE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        tensors: TensorDict = {}
        for name, (m, v) in sorted(self.moments.items()):
            tensors[f"m/{name}"], tensors[f"v/{name}"] = m, v
        atomic_write(folder / MOMENTS_FILE, encode_tensors(tensors, {"round": str(round_)}))

    def load_cloud_state(self, directory: Path, round_: int) -> None:
        """The moments :meth:`save_cloud_state` wrote after round ``round_``; a file of
        another round (a crash between the checkpoint and its moments) or none: the moments
        start afresh, said in the log."""
        path = directory / STATE_DIR / MOMENTS_FILE
        if not path.is_file():
            log.warning("fedadam: no moments in %s; the server optimizer starts afresh",
                        path.parent)  # fmt: skip
            return
        data = path.read_bytes()
        saved = read_metadata(data).get("round")
        if saved != str(round_):
            log.warning("fedadam: %s holds the moments of round %s, not of round %d; the "
                        "server optimizer starts afresh", path, saved, round_ + 1)  # fmt: skip
            return
        tensors = decode_tensors(data)
        names = {k.split("/", 1)[1] for k in tensors}
        if any(f"m/{n}" not in tensors or f"v/{n}" not in tensors for n in names):
            raise CodecError(f"{path}: every tensor needs both its m/ and v/ moments")
        self.moments = {n: (tensors[f"m/{n}"], tensors[f"v/{n}"]) for n in sorted(names)}
