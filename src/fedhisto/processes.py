"""Whether a process is still running, for the code that waits on processes it did not start or cannot reap
(the warm server's jobs, the Flower deployment's sites)."""

from __future__ import annotations

import os
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
