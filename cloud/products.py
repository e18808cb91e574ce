"""What the cloud makes besides the global model: each device's own model (a method's
personalization, off the message loop, sent on the device's private topic) and the product
of a final step after the last round (a method's finalizer, also off the loop), then the
deployment or the end of the run."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from cloud.personal import PersonalizeJob
from cloud.state import CloudBase
from shared.methods.api import Finalizer, FinalResult
from shared.runtime.jobs import WorkerJob
from shared.runtime.service import TensorDict
from shared.wire.messages import (
    PersonalModel,
)

log = logging.getLogger(__name__)


class CloudProducts(CloudBase):
    """The cloud's personal models and its final product."""

    def _collect(self, r: int) -> None:
        """Hand round ``r``'s forwarded uploads to the final step that needs them (before
        the checkpoint, which its files join); they are its alone unless a personalization
        uses them too."""
        finalizer = self.algorithm.finalizer
        if finalizer is None or not self.uploads:
            return
        counts = {d: hello.label_counts for d, hello in self.devices.items()}
        refused = finalizer.collect(r, dict(sorted(self.uploads.items())), self.model, counts)
        for err in refused.values():
            self.reject(err.reason, f"round {r + 1}: {err.detail}")
        if self.algorithm.personalization is None:
            self.uploads = {}

    def _personalize(self, r: int) -> None:
        """Run the algorithm's personalization of round ``r``'s uploads off the loop; then
        send each device its model and open the next round."""
        uploads = dict(sorted(self.uploads.items()))
        self.uploads = {}

        def done(result: Mapping[str, TensorDict] | None, error: BaseException | None) -> None:
            self.personal_job = None
            if error is not None:  # the devices train the global model instead
                log.error("personalization of round %d failed: %s: %s", r + 1,
                          type(error).__name__, error)  # fmt: skip
                self.reject("personalize_failed", f"round {r + 1}: {type(error).__name__}")
                result = None
            self.personal = self._send_personal(result or {})
            with self._transition("opening the round"):
                self._open_round()

        personalization = self.algorithm.personalization
        if personalization is None:  # the caller checked; a narrowing for the type checker
            return
        self.personal_job = PersonalizeJob(
            personalization, r, uploads, self.model, self.ep.call_later, done
        )
        self.personal_job.start()

    def _send_personal(self, models: Mapping[str, TensorDict]) -> bool:
        """Send each device its own model for the round about to open, on the path only
        that device reads; whether any was sent."""
        personalization = self.algorithm.personalization
        for device, tensors in sorted(models.items()):
            ref = self.put_private_tensors(tensors, "personal_model", device)
            mode = personalization.mode_of(device) if personalization is not None else "inversion"
            msg = PersonalModel(
                round=self.round, session=self.session, device=device, model_ref=ref, mode=mode
            )
            self.send(self.topics.device_down(device), msg)
        return bool(models)

    def _finalize(self, finalizer: Finalizer) -> None:
        """Run the method's final step (:meth:`~shared.methods.api.Finalizer.finalize`) off
        the loop, then deploy; a failure fails the run (nothing is deployed)."""
        run_dir = self.checkpoint_dir.parent if self.checkpoint_dir is not None else None
        last: dict[str, float] = {}

        def progress(phase: str, done: int, total: int) -> None:  # the worker's thread
            share = done / max(1, total)
            if share - last.get(phase, -1.0) >= 0.1 or done == total:
                last[phase] = share
                log.info("%s: %s %d/%d", self.cfg.algorithm.name, phase, done, total)

        def done(result: FinalResult | None, error: BaseException | None) -> None:
            self.final_job = None
            if error is not None:
                self.failed = (f"{self.cfg.algorithm.name}'s final step failed: "
                               f"{type(error).__name__}: {error}")  # fmt: skip
                log.error("%s", self.failed)
                return
            self.final = result
            self._trained()

        self.metrics.phase.state("aggregating")
        log.info("%s: the round is in; making the model to deploy", self.cfg.algorithm.name)
        state = self.model
        self.final_job = WorkerJob(
            lambda: finalizer.finalize(state, run_dir, on_progress=progress),
            self.ep.call_later, done, name="finalize", poll_s=1.0,
        )  # fmt: skip
        self.final_job.start()

    def _trained(self) -> None:
        """Deploy (when armed) or declare the run done."""
        if self.on_trained is not None:
            self._publish_state("deploying")
            self.on_trained()
            return
        self.complete()

    def complete(self) -> None:
        """Declare the run done (edges and devices then leave)."""
        if self.done:
            return
        self.done = True
        self._publish_state("done")
        log.info("run finished after %d rounds; global model %s", self.round, self.model_sha[:12])
