"""A device's own classifier, deployed where it was trained (pFedGPA and its baselines): after
its last round the device exports the model it fine-tuned to ONNX (parity-gated on logits and
argmax, :func:`~shared.deploy.classifier_export.export_classifier`), classifies its own test
split with ONNX Runtime and reports what it serves and how accurate it is on its deployment
topic (retained). The cloud never held that model, so nothing about it is signed: a device
signs nothing it did not receive signed."""

from __future__ import annotations

import logging
from pathlib import Path

from device_agent.service import DeviceAgent
from shared.errors import EstuaryError
from shared.wire.messages import DeploymentReport

log = logging.getLogger(__name__)

#: images the parity check compares when the device has no test split (its first ones)
PARITY_IMAGES = 256


class OwnClassifier:
    """Called by ``device`` after its last round (``DeviceAgent.after_last_round``): export,
    classify the test split with ONNX Runtime, report."""

    def __init__(self, device: DeviceAgent, out_dir: Path) -> None:
        self.device = device
        self.out = out_dir / "classifier"

    def __call__(self, round_: int) -> None:
        from shared.deploy.classifier_export import export_classifier
        from shared.deploy.onnx_classifier import OnnxClassifier

        d = self.device
        images = d.test_data if d.test_data is not None else d.data[:PARITY_IMAGES]
        labels = d.test_labels if d.test_data is not None else None
        origin = {"device": d.name, "round": round_, "algorithm": d.cfg.algorithm.name,
                  "session": d.state_session or ""}  # fmt: skip
        try:
            result = export_classifier(
                d.model, self.out, images=images, labels=labels, origin=origin
            )
            served = OnnxClassifier(self.out, threads=d.cfg.deploy.threads)
            run = served.classify(images.numpy(), None if labels is None else labels.numpy())
        except EstuaryError as err:
            log.error("%s: own classifier not deployed: %s", d.name, err)
            d.send(d.topics.device_deploy(d.name),
                   DeploymentReport(device=d.name, event="refused", reason=str(err)[:500],
                                    session=d.joined_session()),
                   retain=True)  # fmt: skip
            return
        accuracy = None if labels is None else float(run.accuracy)
        log.info("%s: exported its own classifier %s (parity %.2g, argmax %.3f); ONNX Runtime "
                 "accuracy on its test split %s at %.0f images/s", d.name, self.out,
                 result.parity.max_abs, result.parity.argmax_agreement,
                 "-" if accuracy is None else f"{accuracy:.4f}", run.images_per_s)  # fmt: skip
        report = DeploymentReport(
            device=d.name, event="classified", model_sha256=result.sha256,
            serving=result.sha256, n=len(run.predictions), images_per_s=run.images_per_s,
            provider=run.provider[:64], accuracy=accuracy, session=d.joined_session(),
        )  # fmt: skip
        d.send(d.topics.device_deploy(d.name), report, retain=True)
