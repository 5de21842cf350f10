from __future__ import annotations

import os
import subprocess
import sys

from fedhisto.infra.processes import running


def test_running_is_true_for_a_live_process_and_false_once_it_exited_reaped_or_not():
    assert running(os.getpid())
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # until it has exited, left unreaped
    os.kill(zombie.pid, 0)  # still answers a signal ...
    assert not running(zombie.pid)  # ... but is not running
    zombie.wait()
    assert not running(zombie.pid)  # reaped: gone from /proc
