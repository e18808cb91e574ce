"""A device's state across restarts (``--state-dir``, the file format in
:mod:`device_agent.state`): taken up at start when it is this device's of this run, written
after every round it trains, dropped when the cloud starts the run over."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

from device_agent.base import DeviceBase
from device_agent.state import DeviceState, read_state, save_state, set_aside
from shared.errors import CodecError, ConfigError, StateError
from shared.models.plan import ChannelPlan, model_spec, parse_plan, plan_doc
from shared.wire.codec import check_spec
from shared.wire.messages import DeviceUpdate

log = logging.getLogger(__name__)


class StateKeeping(DeviceBase):
    """What a device keeps on disk between rounds and runs of its process."""

    def restore_state(self, path: Path | None = None) -> bool:
        """Take up the state saved by this device's last run of this config (in ``path``,
        by default its ``--state-dir`` file), if there is one; an unusable file is moved
        aside (never deleted) and the device starts afresh. Returns whether a state was
        restored."""
        path = path or self.state_file
        if path is None:
            return False
        try:
            saved = read_state(path)
        except (StateError, CodecError, OSError) as err:
            self._set_aside(path, "unreadable", f"{type(err).__name__}: {err}")
            return False
        if saved is None:
            return False
        plan, why = self._check_saved(saved)
        last = None  # the update to resend if its round is announced again
        if not why and saved.last_update is not None:
            try:
                last = DeviceUpdate.model_validate(saved.last_update)
            except ValueError as err:  # pydantic's ValidationError
                why = "bad-update", str(err).splitlines()[0]
        if why:
            self._set_aside(path, *why)
            return False
        self._adopt_arch(plan)
        self.algo_state.clear()
        self.algo_state.update(saved.algo_state)
        if saved.model is not None:
            self.model.load_state_dict(saved.model)
        self.kept_local = saved.kept_local
        self.last_update = last
        self.state_session = saved.session
        self.choices = OrderedDict(((s, r), e) for s, r, e in saved.choices)
        self.metrics.device_state.labels(event="restored").inc()
        log.info(
            "%s: restored its state from %s (round %d of session %s: %s)", self.name, path,
            saved.round, saved.session, ", ".join(sorted(saved.algo_state)) or "no entries",
        )  # fmt: skip
        return True

    def _check_saved(self, saved: DeviceState) -> tuple[ChannelPlan | None, tuple[str, str] | None]:
        """``saved``'s architecture, checked once, and (reason slug, detail) when ``saved``
        is not this device's state for this run (None when it is)."""
        if saved.device != self.name:
            return None, ("other-device", f"it is {saved.device}'s")
        if saved.config_digest != self.config_digest:
            return None, ("other-config", (
                f"saved under config {saved.config_digest}, this run is {self.config_digest}"
            ))  # fmt: skip
        if saved.round >= self.cfg.run.rounds:  # no real round of this run can be that late
            return None, ("bad-round", f"round {saved.round + 1} of a "
                          f"{self.cfg.run.rounds}-round run")  # fmt: skip
        try:
            plan = parse_plan(self.cfg.model.preset, saved.plan)
        except ConfigError as err:
            return None, ("bad-plan", f"bad architecture plan: {err}")
        if saved.model is not None:
            try:
                check_spec(saved.model, model_spec(self.cfg.model.preset, plan))
            except CodecError as err:
                return plan, ("bad-model", str(err))
        return plan, None

    def _set_aside(self, path: Path, reason: str, detail: str) -> None:
        """Move the unusable state file ``path`` aside (never deleted), counted and said."""
        try:
            moved = str(set_aside(path, reason))
        except OSError as err:
            moved = f"not moved ({err})"
        self.metrics.device_state.labels(event="set_aside").inc()
        log.warning("%s: state file %s not used (%s): %s; starting afresh", self.name,
                    path, detail, moved)  # fmt: skip

    def kept_state(self, round_: int, session: str) -> DeviceState:
        """What this device keeps between rounds, as of ``round_`` of ``session``."""
        return DeviceState(
            device=self.name,
            config_digest=self.config_digest,
            plan=plan_doc(self.plan),
            algo_state=self.algo_state,
            round=round_,
            session=session,
            kept_local=self.kept_local,
            model=dict(self.model.state_dict()) if self.kept_local is not None else None,
            last_update=self.last_update.model_dump(mode="json") if self.last_update else None,
            choices=[(s, r, e) for (s, r), e in self.choices.items()],
        )

    def write_state(self, path: Path, round_: int, session: str) -> int:
        """Write :meth:`kept_state` to ``path`` atomically (the ``--state-dir`` format);
        returns the bytes written. StateError or OSError when it cannot be written."""
        state = self.kept_state(round_, session)
        return save_state(path, state, self.algorithm.device.device_cache_keys)

    def save_state(self, round_: int, session: str) -> None:
        """Write what this device keeps between rounds (after a round it trained)."""
        self.state_session = session
        if self.state_file is None:
            return
        try:
            size = self.write_state(self.state_file, round_, session)
        except (StateError, OSError) as err:
            # the round still counts: only a restart would lose what is not on disk
            self.metrics.device_state.labels(event="save_failed").inc()
            log.error("%s: state not saved to %s: %s", self.name, self.state_file, err)
            return
        self.metrics.device_state.labels(event="saved").inc()
        log.debug("%s: state saved (%d bytes)", self.name, size)

    def _start_over(self, session: str) -> None:
        """The first round (index 0) from another session than the kept state's: the cloud
        started the run over (a resumed cloud starts at a later round), so nothing kept applies."""
        log.info("%s: the first round of session %s after session %s: the run started over; "
                 "dropping the state kept from before", self.name, session,
                 self.state_session)  # fmt: skip
        self.algo_state.clear()
        self.kept_local = None
        self.last_update = None
        self.state_session = None
