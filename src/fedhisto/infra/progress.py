"""Progress for people and for logs: a live bar on a terminal, one line per finished step in the log.

Snakemake runs jobs side by side with their stderr on one console (or one CI log), and tqdm's carriage-return
redraws from two jobs interleave there into unreadable fragments (``render:   9%|...``) that also fill every
captured log. So a bar is drawn only when stderr is a terminal and the process is not a Snakemake job
(:func:`disable_bars`, called by ``fedhisto.entry.from_snakemake``), and a step that ends always logs one line
(what, how many, in how long) through :mod:`logging`, which the rule's log file receives.

Use it as tqdm's small subset every call site needs::

    with Progress(total=len(jobs), desc="render", unit="img") as bar:
        for job in jobs:
            ...
            bar.update()

    for out in progress_iter(pool.imap(fn, jobs), total=len(jobs), desc="render", unit="img"):
        ...
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
_bars_allowed = True


def disable_bars() -> None:
    """No live bars in this process (a Snakemake job: its stderr is shared with other jobs)."""
    global _bars_allowed
    _bars_allowed = False
    silence_library_bars()


def silence_library_bars() -> None:
    """Turn off the bars Hugging Face's libraries draw themselves (``Writing model shards``, downloads):
    the environment variable for libraries not imported yet, their switches for those already imported."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    for module, switch in (("huggingface_hub.utils", "disable_progress_bars"),
                           ("transformers.utils.logging", "disable_progress_bar")):
        if module in sys.modules:
            getattr(sys.modules[module], switch)()


def silence_library_bars_off_terminal() -> None:
    """Called when a stage sets up logging: off a terminal no library may draw a bar either."""
    if not bars_enabled():
        silence_library_bars()


def enable_bars() -> None:
    """Undo :func:`disable_bars` (tests); bars are still drawn only on a terminal."""
    global _bars_allowed
    _bars_allowed = True


def bars_enabled() -> bool:
    """A bar is drawn when stderr is a terminal and no caller turned bars off."""
    isatty = getattr(sys.stderr, "isatty", None)
    return _bars_allowed and bool(isatty and isatty())


class Progress:
    """A tqdm bar on a terminal only, and one log line when the step is closed.

    ``summary=False`` skips that line, for loops that already log one line per iteration (the round loop);
    ``bar=False`` never draws the bar (a caller that knows its stderr is shared).
    """

    def __init__(self, total: int | None, desc: str, unit: str = "it", initial: int = 0,
                 logger: logging.Logger | None = None, summary: bool = True, bar: bool = True) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self._initial, self._summary = initial, summary
        self._log = logger or logging.getLogger("fedhisto")
        self._postfix: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr) \
            if bar and bars_enabled() else None
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        """Shown on the bar and appended to the closing log line."""
        self._postfix = values
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if not self._summary:
            return
        seconds = time.perf_counter() - self._start
        done = self.n - self._initial
        of = f"/{self.total}" if self.total is not None else ""
        state = "" if self.total is None or self.n >= self.total else " (stopped early)"
        extra = "".join(f", {k} {v}" for k, v in self._postfix.items())
        rate = f", {done / seconds:.1f} {self.unit}/s" if seconds > 0 and done else ""
        self._log.info("%s: %d%s %s in %.1f s%s%s%s", self.desc, self.n, of, self.unit, seconds, rate, extra, state)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_iter(items: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it",
                  logger: logging.Logger | None = None) -> Iterator[T]:
    """Yield ``items`` with a :class:`Progress` around them (``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, unit, logger=logger) as bar:
        for item in items:
            yield item
            bar.update()
