"""The warm server (fedhisto.infra.warm_server): a job's work runs in a forked child with the job's cwd, environment,
file descriptors and log, returns what the function returns, fails as the job, dies with the job, and trains
exactly as a fresh process does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedhisto.infra import warm_server as warm
from fedhisto.infra.processes import running

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(TESTS), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server on this test's socket (preloading torch only), stopped at the end."""
    folder = tmp_path_factory.mktemp("warm")
    sock = str(folder / "s")  # short: AF_UNIX paths are limited to ~107 bytes
    proc = subprocess.Popen([sys.executable, "-m", "fedhisto.infra.warm_server", "serve", "--socket", sock, "--parent",
                             str(os.getpid()), "--preload", "torch"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "warm server did not start listening"
        time.sleep(0.1)
    yield {"socket": sock, "pid": proc.pid}
    proc.send_signal(signal.SIGTERM)
    # a hang guard: the server's interpreter shutdown (torch loaded) took over 10 s in a fresh-clone CI
    # beside three other lanes
    proc.wait(timeout=120)


def _client(code: str, server: dict | None, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = _env(**extra)
    if server:
        env[warm.ENV_SOCKET] = server["socket"]
    else:
        env.pop(warm.ENV_SOCKET, None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # a hang guard, not a speed check: CI on a slow day took >120 s cold


CALL = ("import json, sys\nfrom fedhisto.infra.warm_server import call\nfrom fedhisto.infra.job_logging import setup_logging\n"
        "setup_logging('job.log')\n")


def test_a_child_runs_in_the_jobs_cwd_environment_streams_and_log(server, tmp_path: Path):
    code = CALL + "print(json.dumps(call('warm_targets:describe', 'M1', log_path='job.log')))"
    proc = _client(code, server, tmp_path, WARM_TEST_VALUE="from the job")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "stdout from the child M1"  # the child writes to the job's own stdout
    out = json.loads(lines[-1])
    assert out["pid"] not in (server["pid"], os.getpid())
    assert out["cwd"] == str(tmp_path) and out["env"] == "from the job"
    assert "log line from the child M1" in (tmp_path / "job.log").read_text()
    assert "log line from the child M1" in proc.stderr
    again = json.loads(_client(code, server, tmp_path).stdout.splitlines()[-1])
    assert again["pid"] != out["pid"]
    # unseeded, each child draws its own numbers, as two fresh processes do (torch seeds from the OS)
    assert again["draw"] != out["draw"]


def test_a_child_that_replied_exits_and_is_not_recorded_as_killed(server, tmp_path: Path):
    """Its job closes the socket once the reply is in: the child's watcher must not SIGKILL it then (the
    server would log the job as ended by a signal and leave a death note no one reads)."""
    for _ in range(3):  # the job closing the socket races the child's exit: a few tries catch a kill
        proc = _client(CALL + "print(json.dumps(call('warm_targets:describe', 'M2')))", server, tmp_path)
        assert proc.returncode == 0, proc.stderr
        child = json.loads(proc.stdout.splitlines()[-1])["pid"]
        deadline = time.monotonic() + 60  # a hang guard: until the server has reaped it
        while Path(f"/proc/{child}").exists():
            assert time.monotonic() < deadline, "the child was not reaped"
            time.sleep(0.05)
        assert not (Path(server["socket"]).parent / f"ended-{child}.json").exists()


def test_without_a_server_or_switched_off_the_job_runs_in_its_own_process(server, tmp_path: Path):
    code = CALL + "import os\nprint(json.dumps([os.getpid(), call('warm_targets:describe', 'M2')['pid']]))"
    alone = json.loads(_client(code, None, tmp_path).stdout.splitlines()[-1])
    off = json.loads(_client(code, server, tmp_path, FEDHISTO_WARM="0").stdout.splitlines()[-1])
    assert alone[0] == alone[1] and off[0] == off[1]
    gone = {"socket": str(tmp_path / "no-server"), "pid": -1}  # a stale name: the job still runs, cold
    stale = json.loads(_client(code, gone, tmp_path).stdout.splitlines()[-1])
    assert stale[0] == stale[1]


def test_a_job_waits_for_a_server_still_importing_and_runs_cold_when_its_process_is_gone(tmp_path: Path):
    """The first jobs of a run start while the server imports torch: they wait for it instead of paying
    the same imports themselves; a server process that died before listening sends them to run cold."""
    code = CALL + "import os\nprint(json.dumps([os.getpid(), call('warm_targets:describe', 'M4')['pid']]))"
    sock = str(tmp_path / "s")
    starting = subprocess.Popen([sys.executable, "-m", "fedhisto.infra.warm_server", "serve", "--socket", sock, "--parent",
                                 str(os.getpid()), "--preload", "torch"], env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
    try:
        assert not os.path.exists(sock)  # the client starts before the server listens
        proc = _client(code, {"socket": sock}, tmp_path, **{warm.ENV_PID: str(starting.pid)})
        assert proc.returncode == 0, proc.stderr
        own, ran = json.loads(proc.stdout.splitlines()[-1])
        assert own != ran  # served by a child of the server it waited for
    finally:
        starting.terminate()
        starting.wait(timeout=120)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t0 = time.monotonic()
    proc = _client(code, {"socket": str(tmp_path / "never")}, tmp_path, **{warm.ENV_PID: str(dead.pid)})
    own, ran = json.loads(proc.stdout.splitlines()[-1])
    assert own == ran and time.monotonic() - t0 < warm.START_WAIT_S


def test_an_exception_in_the_child_fails_the_job_with_its_traceback_in_the_log(server, tmp_path: Path):
    proc = _client(CALL + "call('warm_targets:fail', 'bad value 42', log_path='job.log')", server, tmp_path)
    assert proc.returncode == 1
    log = (tmp_path / "job.log").read_text()
    assert "stage failed: ValueError: bad value 42" in log and "Traceback" in log


def test_a_config_crosses_as_an_equal_config(server, tmp_path: Path):
    from fedhisto.config.study import load_config_file

    code = (CALL + "from fedhisto.config.study import load_config_file\n"
            f"cfg = load_config_file({str(REPO / 'config/config.yaml')!r})\n"
            "print(call('warm_targets:config_dump', cfg))")
    proc = _client(code, server, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == load_config_file(REPO / "config/config.yaml").model_dump_json()


def test_a_child_killed_by_sigkill_is_reported_as_killed_for_memory_with_its_job_and_peak(server, tmp_path: Path):
    """As the OOM killer ends a job's warm child: the job fails naming itself, 'killed for memory', and the
    child's peak resident memory (wait4's ru_maxrss: at least the 300 MiB it touched, plus the server's
    imports it inherited, less than 300 MiB plus torch's ~1.5 GiB)."""
    proc = _client(CALL + "call('warm_targets:grow_then_get_killed', 300, log_path='logs/train/past_v2/seed11.log')",
                   server, tmp_path)
    assert proc.returncode != 0
    last = [line for line in proc.stderr.splitlines() if "WarmJobFailed" in line][-1]
    assert "killed for memory" in last and "SIGKILL" in last
    assert "warm_targets:grow_then_get_killed" in last and "logs/train/past_v2/seed11.log" in last
    import re

    peak = float(re.search(r"peak resident memory ([0-9.]+) GiB", last).group(1))
    assert 300 / 1024 <= peak < (300 + 1536) / 1024, last
    child = re.search(r"in warm child (\d+)", last).group(1)
    assert not (Path(server["socket"]).parent / f"ended-{child}.json").exists()  # the note is read and removed


def test_describe_death_without_a_note_or_with_another_signal():
    from fedhisto.infra.processes import describe_death

    assert "ended without a reply" in describe_death("the job x", None)
    text = describe_death("the job x", {"pid": 1, "signal": signal.SIGSEGV, "maxrss_kb": 2 * 1024 ** 2})
    assert text == "the job x was ended by SIGSEGV (peak resident memory 2.00 GiB)"


def test_killing_the_job_kills_its_child(server, tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    client = subprocess.Popen([sys.executable, "-c", CALL + f"call('warm_targets:sleep_forever', {str(pid_file)!r})"],
                              cwd=tmp_path, env={**_env(), warm.ENV_SOCKET: server["socket"]})
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert child != client.pid
    client.kill()  # as kill -9 of the job, or Snakemake ending it
    client.wait()
    deadline = time.monotonic() + 60  # a hang guard, not a speed check
    while running(child):
        assert time.monotonic() < deadline, "the child outlived its job"
        time.sleep(0.05)


def test_a_warm_training_run_writes_the_files_of_a_fresh_process(server, prepared, tmp_path: Path):
    """The same run of the training stage, through the server and in a process of its own: same bytes. The
    job's own process never imports torch (it would pay torch's import for nothing: the child's reply
    once carried a torch.TorchVersion, so every training job imported torch just to unpickle it)."""
    import yaml

    config = tmp_path / "config.yaml"  # two rounds: every hook of past_v2 runs in each
    doc = yaml.safe_load(Path(prepared["config"]).read_text())
    doc["train"]["max_rounds"] = 2
    config.write_text(yaml.safe_dump(doc))
    out = {}
    for name, srv in (("warm", server), ("cold", None)):
        code = (CALL + "from fedhisto.config.study import load_config_file\n"
                f"cfg = load_config_file({str(config)!r})\n"
                f"call('fedhisto.train.stage:run_train', 'past_v2', 11, {str(prepared['manifest'])!r}, "
                f"{str(prepared['identity'])!r}, {str(prepared['descriptors'])!r}, cfg, {str(tmp_path / name)!r})\n"
                "print(json.dumps({'torch_imported': 'torch' in sys.modules}))")
        proc = _client(code, srv, tmp_path)
        assert proc.returncode == 0, proc.stderr
        if name == "warm":
            assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"torch_imported": False}
        out[name] = tmp_path / name
    assert json.loads((out["warm"] / "report.json").read_text())["pid"] != json.loads(
        (out["cold"] / "report.json").read_text())["pid"]
    for f in ("validation_predictions.csv",):
        assert (out["warm"] / f).read_bytes() == (out["cold"] / f).read_bytes()
    strip = lambda p: [line.rsplit(",", 1)[0] for line in p.read_text().splitlines()]  # noqa: E731 - wall_s last
    assert strip(out["warm"] / "history.csv") == strip(out["cold"] / "history.csv")


def test_a_server_on_other_code_or_failing_sends_the_job_to_run_cold(tmp_path: Path, monkeypatch):
    """Served in this process, one connection at a time (no fork on these paths)."""
    import socket
    import threading

    sock = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    listener.listen(4)
    code = CALL + "import os\nprint(json.dumps([os.getpid(), call('warm_targets:describe', 'M3')['pid']]))"
    def no_fork():
        raise OSError("fork refused (test)")

    for digest in ("another tree's digest", warm._code_digest()):  # other code; this code, but the fork fails
        if digest == warm._code_digest():
            monkeypatch.setattr(warm.os, "fork", no_fork)
        serving = threading.Thread(target=warm._serve_one, args=(listener, digest))
        serving.start()
        proc = _client(code, {"socket": sock}, tmp_path)
        serving.join(timeout=60)
        assert proc.returncode == 0, proc.stderr
        own, ran = json.loads(proc.stdout.splitlines()[-1])
        assert own == ran  # the job ran in its own process
    listener.close()


def test_stop_server_reaps_the_server_it_started(tmp_path: Path, monkeypatch):
    """The Snakefile's onsuccess stops the server and waits for it, so its CPU and its jobs' count in
    Snakemake's children (`/usr/bin/time snakemake ...` sees the whole run), and no zombie is left."""
    for name in (warm.ENV_SOCKET, warm.ENV_PID, warm.ENV_SWITCH):
        monkeypatch.delenv(name, raising=False)
    path = warm.start_server(tmp_path / "warm.log")
    pid = int(os.environ[warm.ENV_PID])
    deadline = time.monotonic() + 300  # a hang guard: the server imports torch and the stages first
    while not os.path.exists(path) and time.monotonic() < deadline:
        assert running(pid), (tmp_path / "warm.log").read_text()
        time.sleep(0.1)
    warm.stop_server()
    with pytest.raises(ChildProcessError):  # already reaped by stop_server
        os.waitpid(pid, os.WNOHANG)
    assert warm.ENV_SOCKET not in os.environ and not os.path.exists(path)
