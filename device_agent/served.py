"""What a device's deployment receiver passes between its steps: a deployment admitted
(checked before its files are fetched), its fetched files, and the model in service."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.deploy.onnx_classifier import (
    OnnxClassifier,
)
from shared.deploy.onnx_sampler import OnnxGenerator
from shared.deploy.signing import (
    DeploymentVersion,
)
from shared.wire.messages import (
    Deployment,
)

if TYPE_CHECKING:
    from shared.config import DeploySection
    from shared.deploy.onnx_classifier import ClassifyResult
    from shared.deploy.onnx_sampler import SampleStats
    from shared.runtime.service import RoleService

log = logging.getLogger(__name__)


@dataclass
class Served:
    """The model in service: the deployment ``sha256``, and ``personal`` (the sha256 of the
    device's own ONNX model) when the generator is the device's own; ``version``: the
    deployment's version (None: not known). A generator deployment has its ``generator``; a
    classifier deployment (task ``"classify"``) its ``classifier`` and no generator."""

    sha256: str
    generator: OnnxGenerator | None
    manifest: dict[str, Any]
    path: Path
    personal: str | None = None
    version: DeploymentVersion | None = None
    classifier: OnnxClassifier | None = None

    @property
    def provider(self) -> str:
        """The execution provider the model in service runs on."""
        model = self.generator if self.generator is not None else self.classifier
        return model.providers[0] if model is not None else ""


@dataclass(frozen=True)
class Admitted:
    """A deployment that passed the checks made before its files are fetched: signature,
    manifest, version and blob references; ``shared``: whether the shared tensors are
    fetched too (the device builds its own model from them)."""

    msg: Deployment
    manifest: dict[str, Any]
    version: DeploymentVersion
    digest: str
    shared: bool

    @property
    def sha256(self) -> str:
        """The signed model's sha256."""
        return str(self.manifest["model"]["sha256"])


@dataclass(frozen=True)
class Fetched:
    """A deployment's files, checked against its manifest."""

    model: bytes
    shared: bytes | None


class DeploymentTask:
    """What the receiver's task handlers (generate: :class:`~device_agent.deploy_sample.
    SampleTask`, classify: :class:`~device_agent.deploy_classify.ClassifyTask`) read of the
    receiver they are mixed into."""

    service: RoleService
    cfg: DeploySection
    out_dir: Path
    served: Served | None

    def _report(
        self, event: str, sha: str | None, *, reason: str = "", request_id: str = "",
        stats: SampleStats | None = None, grid: str = "",
        classified: ClassifyResult | None = None, accuracy: float | None = None,
        deployment: str | None = None,
    ) -> None:  # fmt: skip
        """Report ``event`` on the device's deployment topic (the receiver's)."""
        raise NotImplementedError
