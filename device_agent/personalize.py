"""The device's own generator for algorithms that keep model parts on the devices
(FedDiffuse ULATDEC/UDEC, seed 001 section 4).

The cloud's deployed ONNX model is the global model, whose device-local parts are still at
their initialization: it is not the model any device trained. A training device that holds
local parts builds its own from the deployment's signed ``shared`` file (the global model's
federated tensors) over its local parts (:meth:`~shared.methods.api.DeviceStep.client_state`,
the model the paper evaluates "on client level"), exports it to ONNX on the device and
checks it against torch with the parity gate the cloud's export passed. Only the device's
own parts, which never left it, and signed tensors go into it.

Needs torch (training devices have it); the sampling-only agent never imports this.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from device_agent.deployment import PersonalModel
from shared.deploy.export import check_parity, to_onnx
from shared.errors import EstuaryError, PersonalizeError
from shared.models.plan import build_model, plan_digest
from shared.wire.codec import decode_tensors

if TYPE_CHECKING:
    from device_agent.service import DeviceAgent

log = logging.getLogger(__name__)


class Personalizer:
    """Builds ``agent``'s own generator from a deployment's shared tensors."""

    def __init__(self, agent: DeviceAgent) -> None:
        self.agent = agent

    def holds_local_parts(self) -> bool:
        """Whether the device keeps local parts (it has trained under an algorithm that
        keeps them); without them the global model is the device's model."""
        agent = self.agent
        state = agent.algorithm.device.client_state(agent.model.state_dict(), agent.algo_state)
        return state is not None

    def __call__(self, shared: bytes, card: dict[str, Any]) -> PersonalModel:
        """The device's own model for a deployment whose ``shared`` file is ``shared``
        (verified against the signed manifest) and whose card is ``card``.

        Raises :class:`PersonalizeError` when the device holds no local parts, the
        deployment is for another architecture than the one the device trained, its
        tensors do not fit, or the export fails or misses its parity gate."""
        agent = self.agent
        arch = plan_digest(agent.plan)
        if card.get("arch") != arch:
            raise PersonalizeError(
                f"the deployed architecture {card.get('arch')!r} is not the one this device "
                f"trained its local parts on ({arch!r})"
            )
        spec = agent.algorithm.format.shared_spec(agent.spec)
        if spec is None:
            raise PersonalizeError(f"{agent.cfg.algorithm.name} keeps no local parts")
        try:
            tensors = decode_tensors(shared, expected=spec)
        except EstuaryError as err:
            raise PersonalizeError(f"shared tensors: {err}") from None
        try:
            return self._export({**agent.model.state_dict(), **tensors}, card)
        except PersonalizeError:
            raise
        except Exception as err:  # torch's exporter, ONNX Runtime, a card field of a bad type
            raise PersonalizeError(
                f"export of the device's own model: {type(err).__name__}: {err}"
            ) from None

    def _export(self, global_state: dict[str, Any], card: dict[str, Any]) -> PersonalModel:
        agent, cfg = self.agent, self.agent.cfg
        state = agent.algorithm.device.client_state(global_state, agent.algo_state)
        if state is None:
            raise PersonalizeError("the device holds no local parts for this model")
        model = build_model(cfg.model.preset, agent.plan, seed=cfg.run.seed)
        model.load_state_dict(state)
        model.eval()
        # the gate the cloud's export passed: its threshold and trajectory length
        gate = card.get("parity", {})
        threshold = float(gate.get("threshold", cfg.deploy.parity_threshold))
        steps = int(gate.get("trajectory_steps", cfg.deploy.parity_steps))
        fp16 = card.get("dtype") == "float16"
        onnx = to_onnx(model, opset=int(card.get("opset", cfg.deploy.opset)), fp16=fp16)
        parity = check_parity(
            model, onnx, card, cfg.diffusion, threshold=threshold, steps=steps, seed=cfg.run.seed
        )
        if not parity.passed:
            raise PersonalizeError(
                f"the device's own model differs from torch in ONNX Runtime by "
                f"{parity.worst:.3g}, above the deployment's threshold {threshold:g}"
            )
        log.info("%s: own model exported (%d bytes, parity %.2g)", agent.name, len(onnx),
                 parity.worst)  # fmt: skip
        return PersonalModel(onnx, parity.to_dict())
