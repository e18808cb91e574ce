"""The edge-server aggregator service (DESIGN section 2).

Per round: adopt the global model when the cloud sends one, announce the edge model to the
devices the cloud assigned here, collect their updates until all arrived or the deadline
passed (with at least ``min_updates``), aggregate every ``r_e`` rounds with the algorithm's
edge step, and report to the cloud (with the edge model every ``r_g`` rounds). Duplicate
and late updates are dropped and counted; aggregation happens at most once per round.
It also keeps the label counts of the devices it served since the last cloud aggregation.

With device-selected edges (``federation.assignment`` "select"/"random") the cloud names the
round's participants instead of assigning them; each participant announces its choice with a
``DeviceJoin`` and the edge trains with whoever joined it, closing once every participant
has joined elsewhere, reported here, or dropped out (or at the deadline).
"""

from __future__ import annotations

import logging

from edge_node.report import EdgeReporting
from edge_node.state import _no_work, _shown
from edge_node.updates import UpdateFetching
from shared.data.datasets import NUM_CLASSES, histogram_problem
from shared.errors import ConfigError
from shared.models.plan import parse_plan, plan_digest, plan_doc
from shared.naming import is_device_of
from shared.runtime.service import TensorDict
from shared.wire.codec import encode_tensors, sha256_hex
from shared.wire.messages import (
    DeviceHello,
    DeviceJoin,
    DeviceUpdate,
    EdgeRound,
    Presence,
    RoundStart,
)

log = logging.getLogger(__name__)

MAX_EARLY_JOINS = 100_000  # joins kept for rounds this edge has not opened yet


class EdgeServer(UpdateFetching, EdgeReporting):
    """One edge aggregator, named ``edge_id``."""

    def start(self) -> None:
        """Subscribe to round starts and device updates."""
        self.on(self.topics.cloud_round, RoundStart, self.on_round_start, "msg_round_start")
        t = self.topics
        self.on(t.all_device_up, DeviceUpdate, self.on_device_update, "msg_device_update")
        self.on(t.all_device_status, Presence, self.on_presence, "msg_presence")
        self.on(t.all_device_hello, DeviceHello, self.on_hello, "msg_hello")
        if self.selecting:
            self.on(t.all_device_join, DeviceJoin, self.on_join, "msg_join")
        self.announce_presence(True)
        self._publish_state()

    def on_hello(self, msg: DeviceHello) -> None:
        """Record the label counts a device registered with; count the devices whose home is
        this edge (for the connected-devices gauge). Only the federation's own devices
        count: made-up ids are refused and counted."""
        if not is_device_of(msg.device, self.cfg):
            self.reject("unknown_device", f"{msg.device} is not among the federation's "
                        f"{self.cfg.federation.num_devices} devices")  # fmt: skip
            return
        room = msg.device in self.registered or (
            len(self.registered) < self.cfg.federation.num_devices
        )
        if room and not histogram_problem(msg.label_counts, msg.n_samples):
            self.registered[msg.device] = tuple(msg.label_counts)
        if msg.home_edge == self.name:
            self.my_devices.add(msg.device)
            self.offline.discard(msg.device)
            self._update_device_gauge()

    def on_presence(self, msg: Presence) -> None:
        """A device that goes offline mid-round (LWT) no longer holds the round open."""
        if not is_device_of(msg.name, self.cfg):
            return  # not a device of this federation: never assigned, nothing to track
        if msg.online:
            self.offline.discard(msg.name)
        else:
            self.offline.add(msg.name)
            if not self.closed and msg.name in self.candidates and msg.name not in self.reported:
                log.warning("%s: %s went offline in round %s", self.name, msg.name,
                            _shown(self.round))  # fmt: skip
                self.dropped.add(msg.name)
                self._maybe_close()
        self._update_device_gauge()

    def on_join(self, msg: DeviceJoin) -> None:
        """A participant's edge choice: ours joins the round, another's releases it."""
        if msg.session != self.session or msg.round != self.round:
            if self.round is None or msg.session != self.session or msg.round > self.round:
                # the join outran the round start: keep it for when the round opens
                self.early_joins[(msg.session, msg.round, msg.device)] = msg.edge
                while len(self.early_joins) > MAX_EARLY_JOINS:
                    self.early_joins.popitem(last=False)
            return
        self._apply_join(msg.device, msg.edge)

    def _apply_join(self, device: str, edge: str) -> None:
        if self.closed or device not in self.candidates:
            return
        if edge == self.name:
            self.joined.add(device)
            self.elsewhere.discard(device)
        else:
            self.elsewhere.add(device)
            self.joined.discard(device)
        self._maybe_close()

    def _merge_shared(self, msg: RoundStart) -> tuple[TensorDict | None, bool]:
        """``(state, ok)``: the new global state from its shared tensors (``msg.shared_ref``)
        and the rest of the edge's own state, when that reproduces ``msg.global_ref`` byte
        for byte (the rest never changes in federation); state None when the edge has to
        fetch the whole state. ``ok`` is False when the shared download itself failed
        (rejected and counted): the round start is then dropped like a failed whole fetch,
        rather than waiting out a second download from the same source."""
        shared = self.algorithm.format.shared_spec(self.spec)
        if msg.shared_ref is None or shared is None or self.model is None:
            return None, True
        part = self.fetch_tensors(msg.shared_ref, shared)
        if part is None:
            return None, False
        merged = {**self.model, **part}
        if sha256_hex(encode_tensors(merged)) != msg.global_ref.sha256:
            self.reject(
                "shared_mismatch",
                f"round {msg.round + 1}: the global's shared tensors over this edge's state do "
                "not give the global state; fetching all of it",
            )
            return None, True
        return merged, True

    # -- round start -------------------------------------------------------------------
    def on_round_start(self, msg: RoundStart) -> None:
        """Open round ``msg.round`` for the devices the cloud assigned to this edge.

        A round from a new cloud session (the cloud restarted) is opened even if this edge
        already saw that round number; a replay within the session is a duplicate.
        """
        self.trace.event("round_seen", msg.round)
        same_session = msg.session == self.session
        if same_session and self.round is not None and msg.round <= self.round:
            self.reject("duplicate", f"round {msg.round + 1} already opened")
            return
        new_arch = plan_digest(msg.arch) != plan_digest(self.plan)
        spec, plan = self.spec, self.plan
        if new_arch:
            try:  # the one check of the plan this round start carries
                plan = parse_plan(self.cfg.model.preset, msg.arch)
            except ConfigError as err:
                self.reject("bad_plan", f"bad architecture plan: {err}")
                return
            spec = self._global_spec(plan)
        model = self.model
        kept = not (new_arch or msg.new_global or msg.global_ref.sha256 != self.global_sha)
        if model is None or not kept:  # a new architecture's state replaces the old one's
            # fetched before anything changes: a failed fetch leaves the open round intact
            state, fetched, whole = None, True, False
            if not new_arch:
                state, fetched = self._merge_shared(msg)
            if fetched and state is None:
                # a plain mean never writes to the edge's model: it is read in place from
                # the blob the store keeps (and serves), not copied
                views = self.algorithm.aggregation.aggregation_stateless
                state, whole = self.fetch_tensors(msg.global_ref, spec, views=views), True
                if state is not None:
                    self.trace.event("global_fetched", msg.round, bytes=msg.global_ref.size)
            if state is None:
                return
            if new_arch:
                self._set_arch(plan, spec)
            model = state
            self.model, self.model_ref, self.global_sha = model, None, msg.global_ref.sha256
            if whole and self.algorithm.format.shared_spec(self.spec) is None:
                # the edge serves the global's own bytes (kept in its store by the fetch)
                # instead of encoding the same tensors again
                self.model_ref = msg.global_ref.model_copy(
                    update={"kind": "edge_model", "src": self.home}
                )
            if msg.new_global:
                self.acc_counts, self.acc_n = [0] * NUM_CLASSES, 0  # reset every r_g (eq. 19)
                self.acc_parts = self._zero_parts()
                self.carried = _no_work()
            self.pending = {}  # devices start again from the new state: their work is gone
        counts = msg.edge_counts.get(self.name)
        if self.round is None and not msg.new_global and not self.acc_n and counts:
            # a restarted edge takes back the load it had served from the cloud's record;
            # its model is the global again, so none of that is aggregated work
            reason = self._check_counts(counts)
            if reason:
                self.reject("bad_edge_counts", f"round {msg.round + 1}: {reason}; ignored")
            else:
                self.carried = (sum(counts), list(counts))
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.report_sha is not None:  # the cloud took it: only disk keeps it now
            if self.report_sha != self.global_sha:  # (unless it is the new global itself)
                self.ep.release_blob(self.report_sha)
            # the report before it is two rounds old (no device or cloud asks for it
            # again): its file takes the next blob this edge receives
            before, self.released_report = self.released_report, self.report_sha
            if before is not None and before not in (self.report_sha, self.global_sha):
                self.ep.retire_blob(before)
            self.report_sha = None
        self.session, self.round, self.closed = msg.session, msg.round, False
        if self.selecting:
            self.candidates = list(msg.participants)
        else:
            self.candidates = list(msg.assignment.get(self.name, []))
        self.joined, self.elsewhere = set(), set()
        self.upload = (msg.round + 1) % self.cfg.federation.edge_every == 0
        self.updates, self.reported, self.rejected_this_round = {}, {}, 0
        self.upload_parts = {}
        self.fold = self.algorithm.aggregation.edge_fold(model) if self.upload else None
        self.fetching = {}  # downloads of an earlier round finish and are dropped
        self.reported_n, self.reported_loss, self.reported_seconds = 0, 0.0, 0.0
        self.dropped = {d for d in self.candidates if d in self.offline}
        if self.dropped:
            log.warning("%s: %s offline at the start of round %d; not waiting for them",
                        self.name, ", ".join(sorted(self.dropped)), msg.round + 1)  # fmt: skip
        if not self.candidates:
            self._close()
            return
        if self.model_ref is None:
            self.model_ref, self.shared_ref = self.put_state(
                model, self.algorithm.format.shared_spec(self.spec), "edge_model"
            )
        announce = EdgeRound(
            round=msg.round,
            session=msg.session,
            edge=self.name,
            devices=self.candidates,
            model_ref=self.model_ref,
            shared_ref=self.shared_ref,
            upload=self.upload,
            deadline_s=self.cfg.federation.round_deadline_s,
            select=self.selecting,
            arch=plan_doc(self.plan),
            personal=msg.personal,
        )
        # retained: a device that (re)starts mid-round still learns what to train
        self.send(self.topics.edge_round(self.name), announce, retain=True)
        self.trace.event("announce", msg.round)
        self.deadline_at = self.ep.now() + self.cfg.federation.round_deadline_s
        self.timer = self.ep.call_later(self.cfg.federation.round_deadline_s, self._on_deadline)
        if self.selecting:
            for device in list(self.candidates):
                edge = self.early_joins.pop((msg.session, msg.round, device), None)
                if edge is not None:
                    self._apply_join(device, edge)
            for key in [k for k in self.early_joins if k[0] != msg.session or k[1] < msg.round]:
                del self.early_joins[key]
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.closed:
            return
        settled = set(self.reported) | self.dropped | self.elsewhere
        if all(d in settled for d in self.candidates):
            self._close()

    def _on_deadline(self) -> None:
        if self.closed:
            return
        log.warning(
            "%s round %s deadline: %d/%d updates",
            self.name,
            self.round,
            len(self.reported),
            len(self.assigned),
        )
        self._close()
