"""The method interface: all the roles, the command line, metrics, evaluation and export know
of a federated method.

Services own the rounds and the wire; a method owns its maths. The registry
(:mod:`shared.methods.registry`) builds the method a run config names; the roles read what it
declares (:attr:`Method.traffic`, a :class:`Traffic` value) and call the parts it has
(:attr:`Method.format`, :attr:`Method.device`, :attr:`Method.aggregation`, and the optional
capabilities, None where it has none), never asking which method it is.

What travels is a *state*: the model's tensors plus whatever the method keeps beside them
(SCAFFOLD's server control variate), or tensors that stand for the model (PRISM's
probabilities); every role derives its names and shapes from the model's spec
(:meth:`StateFormat.global_spec`), so validation needs no trust in the sender.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from shared.errors import MessageError
from shared.models.plan import ChannelPlan
from shared.settings import AlgorithmConfig, Traffic
from shared.wire.codec import TensorSpec

if TYPE_CHECKING:
    from shared.config import TrainSection
    from shared.diffusion.training import TrainResult

TensorDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Update:
    """One contribution to an aggregation: tensors plus the weights' ingredients."""

    source: str
    tensors: TensorDict
    n_samples: int
    label_counts: tuple[int, ...]
    #: samples behind each model part (uplink "parts"); None: ``n_samples`` for every part
    part_samples: Mapping[str, int] | None = None


class Fold(ABC):
    """One aggregation fed an update at a time: an aggregator adds each verified update as it
    arrives and asks for the result when its round closes. The result must not depend on the
    order of the updates (the same seed gives the same model on every bus)."""

    #: updates are folded as they come and dropped; False: every update is held until
    #: :meth:`result` (an aggregation that cannot stream)
    streams: ClassVar[bool] = True

    def __init__(self) -> None:
        self.sources: list[str] = []

    def add(self, update: Update) -> None:
        """Fold ``update`` in."""
        self._add(update)
        self.sources.append(update.source)

    @abstractmethod
    def _add(self, update: Update) -> None: ...

    @abstractmethod
    def result(self) -> TensorDict:
        """The aggregate of the updates added (at least one)."""

    def exact_source(self) -> str | None:
        """The source of the one update that :meth:`result` will return bit for bit (same
        names, dtypes, shapes and values), asked before :meth:`result`; None when the result
        is anything else. A role may then serve that update's own bytes as the result
        instead of encoding and hashing the same tensors again. None by default."""
        return None

    def __len__(self) -> int:
        return len(self.sources)


@dataclass
class DeviceContext:
    """Everything a device's local step may use: its private data, its own RNG, the round's
    placement and the method's per-device state (kept by the device across rounds)."""

    device: str
    data: torch.Tensor
    labels: torch.Tensor
    generator: torch.Generator
    round: int = 0
    edge: str = ""
    peers: list[str] = field(default_factory=list)  # devices training at this edge (sorted)
    seed: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    #: the device's own test split (classifiers report their accuracy on it); None: none
    test_data: torch.Tensor | None = None
    test_labels: torch.Tensor | None = None


@dataclass(frozen=True)
class Accuracy:
    """A classifier's accuracy on its device's test split before and after a local round
    (``before`` is None when the round started from no model worth measuring)."""

    before: float | None
    after: float


@dataclass(frozen=True)
class LocalResult:
    """Outcome of a device round; ``tensors`` is None when the round uploads nothing."""

    tensors: TensorDict | None
    train: TrainResult
    #: a classifier's accuracy on the device's test split (None for generators)
    accuracy: Accuracy | None = None


@dataclass
class FinalResult:
    """What a cloud-made product is (:meth:`Finalizer.finalize`): the model the run deploys
    (a classifier's state for FedDEO), that model's preset, and a report."""

    model: TensorDict
    preset: str
    report: dict[str, Any] = field(default_factory=dict)


class StateFormat(Protocol):
    """Names and shapes of what travels, and the model a state stands for."""

    #: the parts an upload may cover (uplink "parts"); empty: every upload covers all
    part_names: tuple[str, ...]

    def init_global(self, model: TensorDict) -> TensorDict:
        """The cloud's first global state from the initial model's tensors."""

    def global_spec(self, model_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Names and shapes of the global (and edge) state for a model of ``model_spec``."""

    def upload_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
        """Names and shapes a device may upload (a subset of them with uplink "parts")."""

    def shared_spec(self, global_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec] | None:
        """The tensors federation changes when a device keeps local parts (roles that hold
        the rest move only these); None: the whole state travels."""

    def upload_parts(self, tensors: Mapping[str, Any]) -> frozenset[str]:
        """The parts (of :attr:`part_names`) an upload covers."""

    def part_uplink(self, model_spec: Mapping[str, TensorSpec], per_edge: Sequence[int]) -> float:
        """Parameters a round's uploads carry in all with uplink "parts" (``per_edge``: the
        devices training at each edge), for the accounting's prediction."""

    def materialize(self, state: TensorDict) -> TensorDict:
        """The model's tensors a state stands for (evaluation, export and deployment build
        the module from them); extra tensors are ignored."""


class DeviceStep(Protocol):
    """A device's part of a round."""

    @property
    def device_cache_keys(self) -> frozenset[str]:
        """Entries of ``DeviceContext.state`` that are caches, rebuilt when missing (a
        device's state file leaves them out)."""

    def needs_download(self, ctx: DeviceContext) -> bool:
        """Whether the device downloads the edge's model this round."""

    def device_holds_rest(self, ctx: DeviceContext, global_spec: Mapping[str, TensorSpec]) -> bool:
        """Whether the device holds every tensor outside the shared spec (it may then
        download only the shared tensors)."""

    def device_load(self, ctx: DeviceContext, model: nn.Module, state: TensorDict) -> None:
        """Put the edge's state into the device's module. ``state``'s tensors are views of
        the received bytes, to be read during this call: copy what is kept (as
        ``load_state_dict`` and ``clone`` do), never write to them."""

    def device_personal(self, ctx: DeviceContext, model: nn.Module, tensors: TensorDict) -> None:
        """Load the model the cloud sent this device for itself (downlink "per_device");
        ``tensors`` are views as in :meth:`device_load`."""

    def device_round(
        self, ctx: DeviceContext, model: nn.Module, round_: int, *, upload: bool
    ) -> LocalResult:
        """Train ``model`` (holding the round's model) on the device's data."""

    def client_state(
        self, global_state: TensorDict, device_state: Mapping[str, Any]
    ) -> TensorDict | None:
        """The device's own model from the global state and its kept state (device_keeps
        "local_parts"); None when that is the global model."""


class Aggregation(Protocol):
    """The edges' and the cloud's aggregation."""

    @property
    def aggregation_stateless(self) -> bool:
        """A plain weighted mean that never reads the roles' own state: they may read their
        model in place from the blob they serve it from."""

    def edge_fold(self, current: TensorDict) -> Fold:
        """The edge's aggregation of one round (``current``: the edge's state)."""

    def cloud_fold(self, current: TensorDict) -> Fold:
        """The cloud's aggregation of the edges' states."""

    def after_cloud_aggregate(
        self, round_: int, state: TensorDict, plan: ChannelPlan | None
    ) -> tuple[TensorDict, ChannelPlan | None]:
        """The cloud's step after it aggregated round ``round_`` (-1: on the initial state);
        returns the state and the architecture plan (FedPhD prunes here)."""

    def round_report(self, round_: int, state: TensorDict) -> dict[str, float]:
        """Figures of the cloud's state at the end of round ``round_``."""

    def round_limit(self, rounds: int) -> int:
        """How many of the configured rounds the run may train (a privacy budget)."""


class Personalization(Protocol):
    """Each device's own model, made on the cloud from every device's upload."""

    def personalize(
        self, round_: int, uploads: Mapping[str, TensorDict], state: TensorDict
    ) -> Mapping[str, TensorDict] | None:
        """Each device's model for the next round (None: the devices train the global
        one); run off the cloud's message loop after the cloud aggregation."""

    def mode_of(self, device: str) -> Literal["inversion", "generation", "guidance"]:
        """How ``device``'s last model was made."""


class Finalizer(Protocol):
    """The product the cloud makes after the last round (product "cloud_made")."""

    def collect(
        self,
        round_: int,
        uploads: Mapping[str, TensorDict],
        state: TensorDict,
        label_counts: Mapping[str, Sequence[int]],
    ) -> dict[str, MessageError]:
        """Keep what the final step needs of round ``round_``'s uploads (cloud_sees
        "every_upload"), each checked against the global ``state`` and the label counts its
        device registered with: called at the cloud's aggregation, before its checkpoint.
        Returns the uploads refused (device -> why), which the cloud counts."""

    def finalize(
        self,
        state: TensorDict,
        out_dir: Path | None,
        *,
        on_progress: Callable[[str, int, int], None] | None = None,
    ) -> FinalResult:
        """The model the run deploys, from the final ``state`` and what the cloud kept;
        files for people in ``out_dir``; runs off the cloud's message loop."""


class StateView(Protocol):
    """What the cloud's state is beyond its tensors: its origin and its own files."""

    #: :meth:`save_cloud_state` writes files (the checkpoint is then written with them)
    keeps_files: bool

    def origin(self) -> str | None:
        """What the first state derives from besides ``model.init`` (recorded in every
        checkpoint; a resume under another origin is refused)."""

    def save_cloud_state(self, directory: Path, round_: int) -> None:
        """Write what the cloud keeps besides the global state beside the checkpoint of
        ``round_`` (atomically; never published)."""

    def load_cloud_state(self, directory: Path, round_: int) -> None:
        """Take back what :meth:`save_cloud_state` wrote (a resumed cloud)."""

    def card_entry(self, module: nn.Module) -> dict[str, Any]:
        """What the model card records about a model this method produced."""


class Preparation(Protocol):
    """What a run needs before any role starts (PRISM: its key)."""

    def prepare(self, run_dir: Path, *, show: bool) -> None:
        """Provide it under ``run_dir`` where it is not configured; ``show``: say where."""


@dataclass
class Centralized:
    """What a centralized ceiling trains: the module the optimizer steps, that optimizer, the
    training settings, the model it stands for after round ``r`` (what is evaluated) and the
    state a checkpoint of round ``r`` holds (what the method's federated runs save)."""

    net: nn.Module
    optimizer: torch.optim.Optimizer
    train: TrainSection
    model: Callable[[int], nn.Module]
    state: Callable[[int], TensorDict]


class CentralTraining(Protocol):
    """What the method's centralized ceiling trains where it is not the model's weights
    (PRISM: the scores over frozen weights)."""

    def centralized(self, model: nn.Module, seed: int) -> Centralized:
        """Training of the initial ``model`` on pooled data; ``seed`` seeds its own draws."""


class Method(Protocol):
    """A federated method as the roles see it (module docstring)."""

    @property
    def name(self) -> str: ...

    settings: AlgorithmConfig
    traffic: Traffic
    personalization: Personalization | None
    finalizer: Finalizer | None
    state_view: StateView | None
    preparation: Preparation | None
    central: CentralTraining | None

    @property
    def format(self) -> StateFormat: ...

    @property
    def device(self) -> DeviceStep: ...

    @property
    def aggregation(self) -> Aggregation: ...


def origin_of(method: Method) -> str | None:
    """What ``method``'s first state derives from besides ``model.init`` (its state view's
    origin), None when nothing else."""
    view = method.state_view
    return view.origin() if view is not None else None
