"""The device's own generator for algorithms that keep model parts on the devices
(FedDiffuse ULATDEC/UDEC, seed 001 section 4).

The cloud's deployed ONNX model is the global model, whose device-local parts are still at
their initialization: it is not the model any device trained. A training device that holds
local parts builds its own from the deployment's signed ``shared`` file (the global model's
federated tensors) over its local parts (:meth:`Algorithm.client_state`, the model the
paper evaluates "on client level"), exports it to ONNX on the device and checks it against
torch with the parity gate the cloud's export passed. Only the device's own parts, which
never left it, and signed tensors go into it.

Needs torch (training devices have it); the sampling-only agent never imports this.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from device_agent.deployment import PersonalizeError, PersonalModel
from shared.arch import build_model, plan_digest
from shared.codec import decode_tensors
from shared.errors import EstuaryError
from shared.export import check_parity, to_onnx

if TYPE_CHECKING:
    from device_agent.service import DeviceAgent

log = logging.getLogger(__name__)


class Personalizer:
    """Builds ``agent``'s own generator from a deployment's shared tensors."""

    def __init__(self, agent: DeviceAgent) -> None:
        self.agent = agent

    def __call__(self, shared: bytes, card: dict[str, Any]) -> PersonalModel | None:
        """The device's own model for a deployment whose ``shared`` file is ``shared``
        (verified against the signed manifest) and whose card is ``card``; None when the
        device holds no local parts (it never trained), so the global model is its model.

        Raises :class:`PersonalizeError` when the deployment is for another architecture
        than the one the device trained, its tensors do not fit, or the export fails its
        parity gate."""
        agent = self.agent
        algorithm = agent.algorithm
        spec = algorithm.shared_spec(agent.spec)
        current = agent.model.state_dict()
        if spec is None or algorithm.client_state(current, agent.algo_state) is None:
            return None  # no local parts: the global model is this device's model
        arch = plan_digest(agent.plan)
        if card.get("arch") != arch:
            raise PersonalizeError(
                f"the deployed architecture {card.get('arch')!r} is not the one this device "
                f"trained its local parts on ({arch!r})"
            )
        try:
            tensors = decode_tensors(shared, expected=spec)
        except EstuaryError as err:
            raise PersonalizeError(f"shared tensors: {err}") from None
        state = algorithm.client_state({**current, **tensors}, agent.algo_state)
        if state is None:
            return None
        cfg = agent.cfg
        model = build_model(cfg.model.preset, agent.plan, seed=cfg.run.seed)
        model.load_state_dict(state)
        model.eval()
        fp16 = card.get("dtype") == "float16"
        threshold = float(card.get("parity", {}).get("threshold", cfg.deploy.parity_threshold))
        try:
            onnx = to_onnx(model, opset=int(card.get("opset", cfg.deploy.opset)), fp16=fp16)
            parity = check_parity(
                model, onnx, card, cfg.diffusion, threshold=threshold,
                steps=cfg.deploy.parity_steps, seed=cfg.run.seed,
            )  # fmt: skip
        except EstuaryError as err:
            raise PersonalizeError(f"export of the device's own model: {err}") from None
        if not parity.passed:
            raise PersonalizeError(
                f"the device's own model differs from torch in ONNX Runtime by "
                f"{parity.worst:.3g}, above the deployment's threshold {threshold:g}"
            )
        log.info("%s: own model exported (%d bytes, parity %.2g)", agent.name, len(onnx),
                 parity.worst)  # fmt: skip
        return PersonalModel(onnx, parity.to_dict())
