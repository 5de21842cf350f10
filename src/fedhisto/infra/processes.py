"""Whether a process is still running, for the code that waits on processes it did not start or cannot reap
(the warm server's jobs, the Flower deployment's sites), and how one that ended without a word ended."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path


def running(pid: int) -> bool:
    """Alive and not a zombie: a process that has exited but is not yet reaped still answers ``kill(pid, 0)``,
    so Linux's ``/proc/<pid>/stat`` state decides. Where there is no ``/proc``, alive is all we can tell."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except IndexError:
        return True  # an unreadable state field: the process is there
    except OSError:
        if Path("/proc/self").exists():
            return False  # /proc is mounted and has no entry: the process is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def death_note(folder: str | Path | None, pid: int, status: int, maxrss_kb: int) -> str:
    """How a reaped child ``pid`` ended (``os.wait4``'s status): ``exit N`` or ``signal N``. One ended by a
    signal is also recorded in ``folder``, with its peak RSS, for the process waiting on its reply, which
    cannot reap it (:func:`read_death_note`); one that exits on its own sent its reply first. A folder
    already gone (the server stopping) records nothing: the job then reports the death without its cause."""
    if not os.WIFSIGNALED(status):
        return f"exit {os.waitstatus_to_exitcode(status)}"
    if folder is not None:
        path = Path(folder) / f"ended-{pid}.json"
        tmp = path.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({"pid": pid, "signal": os.WTERMSIG(status), "maxrss_kb": maxrss_kb}))
            os.replace(tmp, path)
    return f"signal {os.WTERMSIG(status)}"


def read_death_note(folder: str | Path, pid: int, wait_s: float = 5.0) -> dict | None:
    """The record :func:`death_note` writes for ``pid`` (removed once read), waiting up to ``wait_s`` for the
    reaper to write it; ``None`` when none came (the reaper gone, or the child not ended by a signal)."""
    path = Path(folder) / f"ended-{pid}.json"
    deadline = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        note = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return note


def describe_death(what: str, note: dict | None) -> str:
    """``what`` (a job, a process) ended without a reply: why, in the user's words. SIGKILL with no one
    asking is how Linux's out-of-memory killer ends a process, so that is what it is called, with the
    process's peak resident memory (the figure to compare with the job's ``mem_mb``)."""
    if note is None:
        return f"{what} ended without a reply (killed, or it crashed below Python)"
    sig = note["signal"]
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    peak = f"peak resident memory {note['maxrss_kb'] / 1024 ** 2:.2f} GiB"
    if sig == signal.SIGKILL:
        return (f"{what} was killed for memory: SIGKILL at {peak}, as the kernel's out-of-memory killer ends a "
                "process (`dmesg` or `journalctl -k` names it). Run fewer such jobs at once (--resources "
                "mem_mb=..., or --cores 1) or give the job more memory (a larger mem_mb on a cluster)")
    return f"{what} was ended by {name} ({peak})"


def available_memory_mb(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """The host's memory a new job can have now, in MB (``MemAvailable``: free memory plus what the kernel
    can reclaim, less what other processes hold); ``None`` where it cannot be read (no /proc)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
