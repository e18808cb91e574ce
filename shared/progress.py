"""Progress bars that show on every terminal.

A pseudo-terminal that never had its size set (``script`` without a terminal, some
``docker exec -t`` and CI runners) reports 0 columns and 0 rows; tqdm then takes the bar's
line to be below the screen and draws nothing: the bar vanishes. :func:`progress_bar` gives
such a terminal a fixed size and leaves every other case to tqdm.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from tqdm import tqdm

__all__ = ["FALLBACK_COLUMNS", "FALLBACK_ROWS", "bar_columns", "progress_bar"]

#: size of a terminal that reports none
FALLBACK_COLUMNS, FALLBACK_ROWS = 120, 24


def bar_columns(stream: IO[str] | None = None) -> int | None:
    """:data:`FALLBACK_COLUMNS` when ``stream`` (default: stderr, where tqdm writes) is a
    terminal reporting 0 columns; else None (tqdm sizes the bar itself)."""
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty() and os.get_terminal_size(stream.fileno()).columns == 0:
            return FALLBACK_COLUMNS
    except (OSError, ValueError, AttributeError):  # no file descriptor, or a closed one
        pass
    return None


def progress_bar(*args: Any, **kwargs: Any) -> tqdm[Any]:
    """``tqdm(*args, **kwargs)``, sized on a terminal that reports no size."""
    if kwargs.get("ncols") is None and bar_columns(kwargs.get("file")) is not None:
        kwargs["ncols"], kwargs["nrows"] = FALLBACK_COLUMNS, FALLBACK_ROWS
    return tqdm(*args, **kwargs)
