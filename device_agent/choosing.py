"""A device's choice of an edge for a round (``federation.assignment = "select"`` or
``"random"``): FedPhD eq. 25 (or a uniform draw) from its own seeded RNG over the edges it
has not seen go offline, once every earlier participant (sorted order) has chosen or is
offline, or after ``join_timeout_s``; then it tells everyone and trains when that edge's
announcement is here."""

from __future__ import annotations

import logging

from device_agent.base import MAX_PENDING_ROUNDS, DeviceBase
from shared.data.datasets import histogram_problem
from shared.federation.selection import (
    choose_edge,
    selection_probs,
    selection_rng,
    selection_settings,
)
from shared.wire.messages import DeviceJoin, Presence, RoundStart

log = logging.getLogger(__name__)

MAX_KEPT_JOINS = 100_000  # other participants' choices kept (this and the next rounds)


class EdgeChoosing(DeviceBase):
    """The device's part in edge selection."""

    def on_presence(self, msg: Presence) -> None:
        """Remember which edges and devices are offline (their last will): an offline edge
        is not chosen, an offline earlier participant is not waited for."""
        target = self.offline_edges if msg.role == "edge" else self.offline_devices
        if msg.online:
            target.discard(msg.name)
        else:
            target.add(msg.name)
            if msg.role == "device" and self.selection is not None:
                self._decide()

    def on_join(self, msg: DeviceJoin) -> None:
        """Another participant's choice; the choice this device waits for may be complete."""
        if msg.device == self.name:
            return
        reason = histogram_problem(msg.label_counts)
        if reason:
            self.reject("bad_join", f"{msg.device} round {msg.round + 1}: {reason}")
            return
        if self._stale(msg.session, msg.round):
            log.debug("%s: dropped %s's join for past round %d", self.name, msg.device,
                      msg.round + 1)  # fmt: skip
            return
        self.joins[(msg.session, msg.round, msg.device)] = (msg.edge, tuple(msg.label_counts))
        while len(self.joins) > MAX_KEPT_JOINS:
            self.joins.popitem(last=False)
        if self.selection is not None and self.selection.session == msg.session:
            self._decide()

    def _stale(self, session: str, round_: int) -> bool:
        """Whether ``(session, round_)`` is before the current round of the current session."""
        return self.current is not None and session == self.current[0] and round_ < self.current[1]

    def _advance(self, session: str, round_: int) -> None:
        """Make ``(session, round_)`` current (unless it is in the past) and drop the joins
        that are not for it or a later round of its session."""
        if self._stale(session, round_):
            return
        self.current = (session, round_)
        for key in [k for k in self.joins if k[0] != session or k[1] < round_]:
            del self.joins[key]

    def on_round_start(self, msg: RoundStart) -> None:
        """A participant picks its edge once every earlier participant (sorted order) has
        picked or is offline, or after ``join_timeout_s``; then it tells everyone and trains
        when that edge's announcement is here (it may already be)."""
        if not msg.edge_counts:
            return
        for edge, counts in msg.edge_counts.items():
            reason = histogram_problem(counts)
            if reason:
                self.reject("bad_edge_counts", f"round {msg.round + 1}, edge {edge}: {reason}")
                return
        self._advance(msg.session, msg.round)
        if self.name not in msg.participants:
            return
        key = (msg.session, msg.round)
        if key in self.choices:  # a replay (reconnect, restarted edge): repeat the choice
            self._joined(msg, self.choices[key])
            return
        if self.selection is not None and self.sel_timer is not None:
            self.sel_timer.cancel()
        self.selection = msg
        self.sel_timer = self.ep.call_later(
            self.cfg.federation.join_timeout_s, lambda: self._decide(force=True)
        )
        self._decide()

    def _decide(self, force: bool = False) -> None:
        msg = self.selection
        if msg is None:
            return
        order = sorted(msg.participants)
        before = order[: order.index(self.name)]
        known = {d: self.joins.get((msg.session, msg.round, d)) for d in before}
        waiting = [d for d, j in known.items() if j is None and d not in self.offline_devices]
        if waiting and not force:
            return
        if waiting:
            log.warning(
                "%s: round %d: choosing without %d earlier choices", self.name, msg.round,
                len(waiting),
            )  # fmt: skip
        self.selection = None
        if self.sel_timer is not None:
            self.sel_timer.cancel()
            self.sel_timer = None
        counts = {e: list(c) for e, c in msg.edge_counts.items()}
        for j in known.values():
            if j is not None and j[0] in counts:  # lengths were checked on receipt
                counts[j[0]] = [a + b for a, b in zip(counts[j[0]], j[1], strict=True)]
        try:
            edge = self.choose(msg.round, counts)
        except ValueError:
            self.reject("no_edge_online", f"round {msg.round + 1}")
            return
        self.choices[(msg.session, msg.round)] = edge
        while len(self.choices) > MAX_PENDING_ROUNDS:
            self.choices.popitem(last=False)
        log.debug("%s round %d picked %s", self.name, msg.round + 1, edge)
        self._joined(msg, edge)

    def choose(self, round_: int, edge_counts: dict[str, list[int]]) -> str:
        """This device's edge for ``round_`` (eq. 25 or uniform) among the online edges."""
        edges = sorted(edge_counts)
        rng = selection_rng(self.cfg.run.seed, self.index, round_)
        if self.cfg.federation.assignment == "random":
            probs = {e: 1.0 / len(edges) for e in edges}
        else:
            a, b, target = selection_settings(self.cfg)
            probs = selection_probs(edge_counts, self.label_counts, a, b, target)
        online = {e for e in edges if e not in self.offline_edges}
        return choose_edge(probs, online, rng)

    def _joined(self, msg: RoundStart, edge: str) -> None:
        join = DeviceJoin(
            round=msg.round,
            session=msg.session,
            device=self.name,
            edge=edge,
            label_counts=self.label_counts,
        )
        self.send(self.topics.device_join(self.name), join)
        pending = self.announced.pop((msg.session, msg.round, edge), None)
        if pending is not None:
            self.train_round(pending)
