"""Rate-limited logging: a flood of one bad input writes a handful of lines, not thousands.

Every rejection is still counted (``estuary_rejected_messages_total``); the log gets
:data:`REJECT_LOG_BURST` lines per reason a minute, the next line saying how many it left out.

Text from the wire (ids, topics, reasons, reports) goes through :func:`printable` before it
reaches a log line or a terminal: a line break, a terminal escape sequence or a bidi override
in it is shown as an escape (``\\n``, ``\\x1b``, ``\\u202e``), so it can neither forge a log line
nor drive the operator's terminal. :class:`EscapingFormatter` does the same to every log
message a process writes (its traceback, if any, left as it is).
"""

from __future__ import annotations

import logging
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger(__name__)

#: rejections logged per reason and window; the rest are counted (as every rejection is, in
#: ``estuary_rejected_messages_total``) and summed up in the next line logged for that reason
REJECT_LOG_BURST, REJECT_LOG_WINDOW_S = 5, 60.0


#: characters :func:`printable` escapes: control (Cc: C0, DEL, C1), format (Cf: bidi
#: overrides, zero-width), line and paragraph separators (Zl, Zp), surrogates and unassigned
_UNPRINTABLE = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"))


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character that is not plain printable text (line breaks, escape
    sequences, bidi overrides, ...) written as its Python escape (``\\n``, ``\\x1b``);
    text without such characters is returned as it is."""
    if text.isprintable():
        return text
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNPRINTABLE else ch for ch in text)


class EscapingFormatter(logging.Formatter):
    """A formatter whose every message goes through :func:`printable`: a log line stays
    one line whatever a message interpolated. An exception's traceback, added after the
    message, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def escaping_handler(stream: TextIO, fmt: str) -> logging.Handler:
    """A stream handler writing ``fmt`` lines through :class:`EscapingFormatter`."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter(fmt))
    return handler


class LogLimiter:
    """At most ``burst`` log lines per key in each ``window_s``: a flood of one bad message
    (10,000 copies) writes a handful of lines, not 10,000. Keys are bounded (``max_keys``,
    least recently used dropped)."""

    def __init__(
        self,
        burst: int = REJECT_LOG_BURST,
        window_s: float = REJECT_LOG_WINDOW_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 256,
    ) -> None:
        self.burst, self.window_s, self.clock, self.max_keys = burst, window_s, clock, max_keys
        self._keys: OrderedDict[str, _Window] = OrderedDict()

    def admit(self, key: str) -> int | None:
        """None: do not log this one (counted as suppressed). Else the number suppressed
        since the last line logged for ``key`` (to say so in this one)."""
        now = self.clock()
        window = self._keys.pop(key, None)
        if window is None or now - window.start >= self.window_s:
            window = _Window(now, suppressed=window.suppressed if window is not None else 0)
        self._keys[key] = window
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        if window.logged >= self.burst:
            window.suppressed += 1
            return None
        window.logged += 1
        suppressed, window.suppressed = window.suppressed, 0
        return suppressed

    def warn(self, key: str, message: str, logger: logging.Logger | None = None) -> None:
        """Log ``message`` as a warning when :meth:`admit` lets ``key`` through, saying how
        many lines of ``key`` were left out before it and when the window is used up."""
        suppressed = self.admit(key)
        if suppressed is None:
            return
        notes = []
        if suppressed:
            notes.append(f"{suppressed} more not logged before this one")
        if self.exhausted(key):
            notes.append(f"further '{key}' lines in the next {self.window_s:.0f} s at most "
                         "are counted, not logged")  # fmt: skip
        more = f" [{'; '.join(notes)}]" if notes else ""
        (logger or log).warning("%s%s", message, more)

    def exhausted(self, key: str) -> bool:
        """Whether ``key`` has used its lines of the current window (the line just admitted
        was the last one)."""
        window = self._keys.get(key)
        return window is not None and window.logged >= self.burst


@dataclass
class _Window:
    """One key's current window: when it started, the lines logged in it, and the lines
    left out since the last one logged."""

    start: float
    logged: int = 0
    suppressed: int = 0
