"""Traffic and rejection counters shared by every endpoint of a process.

Communication cost is reported from these counters: bytes and messages sent and received,
per message kind. Thread-safe; cheap enough to call on every message.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Traffic:
    """Counters keyed by (direction, kind); direction is ``sent`` or ``received``."""

    _bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _messages: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _rejected: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _transport: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, direction: str, kind: str, nbytes: int) -> None:
        """Record one message of ``nbytes`` in ``direction`` for ``kind``."""
        with self._lock:
            self._bytes[(direction, kind)] += nbytes
            self._messages[(direction, kind)] += 1

    def reject(self, who: str, reason: str) -> None:
        """Record one rejected message with its reason label."""
        with self._lock:
            self._rejected[(who, reason)] += 1

    def note(self, name: str, value: float = 1.0) -> None:
        """Add ``value`` to the transport counter ``name`` (reconnects, chunks resent, ...)."""
        with self._lock:
            self._transport[name] += value

    def transport(self) -> dict[str, float]:
        """Transport counters by name (wire bytes, reconnects, blob cache hits, ...)."""
        with self._lock:
            return dict(sorted(self._transport.items()))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"bytes": {"sent:kind": n}, "messages": {...}, "rejected": {"who:reason": n}}``."""
        with self._lock:
            return {
                "bytes": {f"{d}:{k}": v for (d, k), v in sorted(self._bytes.items())},
                "messages": {f"{d}:{k}": v for (d, k), v in sorted(self._messages.items())},
                "rejected": {f"{w}:{r}": v for (w, r), v in sorted(self._rejected.items())},
            }

    def total(self, direction: str, kind: str | None = None) -> int:
        """Bytes in ``direction``, for one kind or all kinds."""
        with self._lock:
            return sum(
                v for (d, k), v in self._bytes.items() if d == direction and kind in (None, k)
            )


def diff_counts(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Per-key difference of two counter snapshots (keys absent before count from zero)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
