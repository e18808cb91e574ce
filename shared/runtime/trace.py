"""A role's round timeline: timestamped events as JSON lines, for finding where a round's
time goes (``benchmarks/round_phases.py`` reads them).

Off unless the environment names a directory: with ``ESTUARY_TRACE_DIR=DIR`` every role
process appends to ``DIR/<name>.jsonl`` one line per event, ``{"t": <unix time>, "who":
<name>, "ev": <event>, "round": <0-based round or null>, ...}``. Wall-clock times, so the
lines of roles on one machine line up; each line also carries the process's resident memory
then (``rss_mib``, from ``/proc/self/statm``; absent where that cannot be read). A file
stops growing at :data:`MAX_TRACE_BYTES` (said once in the log); a file that cannot be
written turns tracing off for the process.

Events (``round`` is the federated round they belong to):

- cloud: ``announce`` (RoundStart sent), ``edge_report`` (an EdgeUpdate arrived),
  ``edge_fetched`` (its model downloaded and verified), ``aggregated``, ``checkpointed``,
  ``closed``
- edge: ``round_seen``, ``global_fetched``, ``announce`` (EdgeRound sent), ``update_seen``
  (a DeviceUpdate arrived), ``update_fetched``, ``aggregated``, ``reported`` (EdgeUpdate
  sent)
- device: ``round_seen`` (EdgeRound arrived), ``downloaded``, ``trained`` (with
  ``train_s``), ``uploaded`` (DeviceUpdate sent)
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_DIR = "ESTUARY_TRACE_DIR"
#: a trace file stops growing here (a few hundred bytes per event: ~100,000 events)
MAX_TRACE_BYTES = 32 * 2**20
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 0.0


def _rss_mib() -> float | None:
    """This process's resident memory in MiB (None where ``/proc`` cannot tell)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return round(int(fh.read().split()[1]) * _PAGE_MIB, 1)
    except (OSError, ValueError, IndexError):
        return None


class Trace:
    """Appends one role's events to its trace file; does nothing when tracing is off."""

    def __init__(self, name: str, directory: str | Path | None = None) -> None:
        self.name = name
        where = os.environ.get(ENV_DIR, "") if directory is None else str(directory)
        self.path = Path(where) / f"{_SAFE_NAME.sub('_', name)}.jsonl" if where else None
        self._written = 0
        self._lock = threading.Lock()
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._written = self.path.stat().st_size if self.path.exists() else 0
            except OSError as err:
                log.warning("%s: no round trace (%s): %s", name, self.path, err)
                self.path = None

    @property
    def enabled(self) -> bool:
        """Whether events are written."""
        return self.path is not None

    def event(self, ev: str, round_: int | None, **fields: Any) -> None:
        """Record event ``ev`` of round ``round_`` now, with ``fields`` (JSON values)."""
        if self.path is None:
            return
        record = {"t": round(time.time(), 6), "who": self.name, "ev": ev, "round": round_}
        rss = _rss_mib()
        if rss is not None:
            record["rss_mib"] = rss
        line = json.dumps({**record, **fields}, separators=(",", ":"))
        with self._lock:
            if self.path is None:
                return
            if self._written + len(line) + 1 > MAX_TRACE_BYTES:
                log.warning("%s: round trace %s reached %d bytes; no more events are written",
                            self.name, self.path, MAX_TRACE_BYTES)  # fmt: skip
                self.path = None
                return
            try:
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
            except OSError as err:
                log.warning("%s: round trace off: %s", self.name, err)
                self.path = None
                return
            self._written += len(line) + 1
