"""Progress bars for a person at a terminal, never for a log file.

A rule log is not a terminal: tqdm's carriage-return fragments (``render: 9%|...``) interleave there
and say nothing a line per step would not. ``progress`` is tqdm on a TTY and a silent stand-in
elsewhere; stages log one line per step themselves.
"""

from __future__ import annotations

import sys
from typing import Any


def progress(iterable: Any = None, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)``, disabled unless standard error is a terminal."""
    from tqdm import tqdm

    kwargs.setdefault("disable", not sys.stderr.isatty())
    return tqdm(iterable, **kwargs)
