"""The cloud's records of a round: the atomic checkpoint after an aggregation (with the
method's own files beside it, written with it) and the round's summary."""

from __future__ import annotations

import logging
import time

from cloud.rounds import RoundSummary
from cloud.state import CloudBase
from shared.models.checkpoint import save_checkpoint
from shared.models.plan import plan_digest
from shared.runtime.memory import release_memory

log = logging.getLogger(__name__)


class CloudCheckpoints(CloudBase):
    """The cloud's checkpoints and round summaries."""

    def _checkpoint(self, r: int) -> None:
        every = self.cfg.eval.checkpoint_every
        last = r + 1 >= self.rounds
        if self.checkpoint_dir is not None and every and (self.aggregations % every == 0 or last):
            directory, model, plan, init, sha = (
                self.checkpoint_dir,
                self.model,
                self.plan,
                self.init,
                self.model_sha,
            )
            view = self.algorithm.state_view
            own_state = view is not None and view.keeps_files
            if self.on_checkpoint is not None:
                self.on_checkpoint(r)

            def write() -> None:
                save_checkpoint(directory, r, model, self.cfg, plan=plan, init=init,
                                model_sha256=sha)  # fmt: skip
                release_memory()  # the writer's buffers: freed after the round's own trim

            # inline where the algorithm writes files of its own beside it (they must match)
            # and at the end of the run (what follows reads it)
            self.checkpoints.write(write, inline=own_state or last)
            if view is not None:
                view.save_cloud_state(self.checkpoint_dir, r)

    def _summarize(
        self, r: int, aggregated: bool, agg_seconds: float, trained_arch: str
    ) -> RoundSummary:
        reports = [m for m, _ in self.reports.values()]
        losses = [(m.mean_loss, len(m.devices)) for m in reports if m.mean_loss is not None]
        n_up = sum(len(m.devices) for m in reports)
        return RoundSummary(
            round=r,
            participants=len(self.participants),
            updates=n_up,
            mean_loss=sum(lo * k for lo, k in losses) / n_up if n_up else None,
            cloud_aggregated=aggregated,
            model_sha256=self.model_sha,
            round_seconds=time.perf_counter() - self.opened_at,
            aggregation_seconds=agg_seconds,
            train_seconds=sum(m.train_seconds for m in reports),
            rejected=sum(m.rejected for m in reports),
            edges={m.edge: len(m.devices) for m in reports},
            accuracy={
                d: (a.before, a.after) for m in reports for d, a in (m.accuracy or {}).items()
            },
            model_params=self.model_params(),
            arch=plan_digest(self.plan),
            trained_arch=trained_arch,
            final=r + 1 >= self.rounds,
            algorithm=self.algorithm.aggregation.round_report(r, self.model),
        )
