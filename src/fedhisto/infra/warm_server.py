"""Warm stage processes: import torch, transformers and peft once per local Snakemake run, not once per job.

Every torch stage job used to spend 3-4 s of CPU importing torch, transformers and peft (peft alone pulls in
transformers' auto classes, ``torch.distributed.tensor`` and sympy) before its first useful line; the embedded
default runs about 75 such jobs on 2 cores. Under a local Snakemake run the Snakefile's ``onstart`` starts one
*warm server* (:func:`start_server`): a process that imports those libraries and the stage modules once, then,
for each job, forks a child that runs the job's stage function. A fork is a copy of the warm process, so the child
starts with everything imported and nothing computed.

What a child is, and why its results are those of a fresh process:

- it runs ``module:function`` with the job's pickled arguments, in the job's working directory and with the job's
  environment (``os.environ`` replaced by the client's), its stdin/stdout/stderr the job's own file descriptors
  (passed over the socket), its log file set up by the job (:func:`fedhisto.infra.job_logging.setup_logging`, appending);
- the server computes nothing: it never runs a torch operation, so no intra-op thread pool, CUDA context or
  random draw is inherited (its only other threads are the BLAS libraries' idle worker pools, which OpenBLAS
  re-creates in a forked child through its ``pthread_atfork`` handler); the child reseeds the unseeded global generators (Python's, NumPy's, torch's) from the
  OS as a fresh process does, and the stage sets its threads and seeds as it does in a fresh process
  (``tests/test_warm.py`` checks a training run's files are byte-identical either way);
- it lives exactly as long as the job: the job process waits on the socket, and a thread in the child ends the
  child the moment that socket closes (the job killed by Snakemake, ``kill -9`` or a signal), so killing a job
  kills its work as before, and a checkpointed run resumes as before;
- its exit status becomes the job's: an exception is logged to the job's log (as a fresh job logs it) and the
  job exits 1.

The server runs only for local execution (never under a cluster executor, where jobs run on other hosts and
under the scheduler's limits, nor with ``--use-conda``, whose jobs use another interpreter), listens on a socket
in a private (0700) temporary folder named in ``FEDHISTO_WARM_SOCKET``, ends when Snakemake ends (``onsuccess`` /
``onerror``, or when its parent process is gone). It serves only jobs whose package code has the digest it
started with (``fedhisto.infra.code_identity.source_digest``): after an edit mid-run, jobs run cold on the new code. A
job that finds no server (not started, gone, ``FEDHISTO_WARM=0``), or that the server cannot serve, runs in its own
process, as before. A job that finds the server still importing (its process alive, ``FEDHISTO_WARM_PID``, but not
yet listening) waits for it, up to ``START_WAIT_S``: the server's imports take about what the job's own would,
so running cold would only pay them twice (the first jobs of every run did: about 6 s of CPU each).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedhisto.infra.processes import death_note, describe_death, read_death_note, running

ENV_SOCKET = "FEDHISTO_WARM_SOCKET"
ENV_SWITCH = "FEDHISTO_WARM"  # "0": no server, every job in its own process
ENV_PID = "FEDHISTO_WARM_PID"  # the server process start_server started: a job waits while it is importing
START_WAIT_S = 120.0  # a hang guard: the server's imports take seconds; past this, the job runs cold
#: What the server imports before it listens: what the torch stages' start-up spends its time on.
PRELOAD = ("torch", "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers", "peft",
           "fedhisto.train.stage", "fedhisto.predict.stage", "fedhisto.pretrain.stage", "fedhisto.accounting.stage", "fedhisto.stain.stage",
           "fedhisto.metrics.stage", "fedhisto.bootstrap.stage", "fedhisto.report.stage", "sklearn.metrics", "fedhisto.infra.plotting")
# Each job's two lines in the server's log: its log file and the job process's own CPU up to the call
# (interpreter, Snakemake's script preamble, config), then the child's end with its CPU (wait4: the child and
# its reaped descendants). benchmarks/pipeline_timeline.py reads them into a per-job timeline.
STARTED_LINE = "warm server: %s for pid %s in child %d (log %s, job process %.2f s CPU before the call)"
ENDED_LINE = "warm server: child %d ended (%s), peak resident memory %.2f GiB, CPU %.2f s user %.2f s system"
_HEADER = struct.Struct("!Q")
_SHUTDOWN = "__shutdown__"
_STARTED: list[str] = []  # sockets of the servers this process started (and so stops)
_PROCESSES: dict[str, subprocess.Popen] = {}  # their processes, waited for when stopped
log = logging.getLogger(__name__)


class WarmJobFailed(RuntimeError):
    """The forked child of a job ended without a reply (killed, or crashed below Python); the message says
    which signal and the child's peak resident memory when the server saw it end (a SIGKILL: for memory)."""


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"warm target {target!r} must be 'package.module:function'")
    return getattr(importlib.import_module(module), name)


class _Pickler(pickle.Pickler):
    """Pickles a :class:`fedhisto.config.study.Config` as its JSON dump, re-validated on the other side: the registry's
    per-method config classes are built at run time and cannot be pickled by reference (the dump round-trips to
    an equal config, ``tests/test_warm.py``)."""

    def reducer_override(self, obj: Any) -> Any:
        config = sys.modules.get("fedhisto.config.study")
        if config is not None and isinstance(obj, config.Config):
            # by reference to the config module's own loader: this ground-floor module names no config code
            return config.load_config, (obj.model_dump(mode="json"), "warm job (the job's validated config)")
        return NotImplemented


def _dumps(payload: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return buffer.getvalue()


def _send(conn: socket.socket, payload: Any, fds: list[int] | None = None) -> None:
    data = _dumps(payload)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(conn, [header], fds)
    else:
        conn.sendall(header)
    conn.sendall(data)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("warm socket closed mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(conn: socket.socket, with_fds: int = 0) -> tuple[Any, list[int]]:
    if with_fds:
        header, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, with_fds)
        if len(header) < _HEADER.size:
            header += _recv_exact(conn, _HEADER.size - len(header))
    else:
        header, fds = _recv_exact(conn, _HEADER.size), []
    (size,) = _HEADER.unpack(header)
    return pickle.loads(_recv_exact(conn, size)), list(fds)


# --------------------------------------------------------------------------------------------- client side
def call(target: str, *args: Any, log_path: str | None = None, **kwargs: Any) -> Any:
    """Run ``target`` (``'package.module:function'``) with these arguments: in a warm child when a server
    on this very code is reachable, else here. Returns what the function returns."""
    path = os.environ.get(ENV_SOCKET)
    conn = None
    if path and os.environ.get(ENV_SWITCH, "1") != "0":
        _wait_while_starting(path, os.environ.get(ENV_PID))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
        except OSError:  # no server (not ready yet, or gone): this job runs in its own process, as before
            conn.close()
            conn = None
    if conn is None:
        return _resolve(target)(*args, **kwargs)
    with conn:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        request = {"target": target, "code": _code_digest(), "cwd": os.getcwd(), "env": dict(os.environ),
                   "log_path": log_path, "client_pid": os.getpid(), "client_cpu_s": time.process_time(),
                   "call": _dumps((args, kwargs))}
        _send(conn, request, [0, 1, 2])
        try:
            started, _ = _recv(conn)
        except EOFError:
            started = {"status": "cold", "why": "the server closed the connection before starting the job"}
        if started["status"] == "cold":  # nothing ran there: run here
            log.info("warm server not used for %s: %s", target, started["why"])
        else:
            try:
                reply, _ = _recv(conn)
            except EOFError:
                pid = started.get("pid")
                note = read_death_note(os.path.dirname(path), pid) if isinstance(pid, int) else None
                job = f"the job {target}{f' (log {log_path})' if log_path else ''}, in warm child {pid},"
                raise WarmJobFailed(describe_death(job, note)) from None
    if started["status"] == "cold":
        return _resolve(target)(*args, **kwargs)
    if reply["status"] == "ok":
        return reply["value"]
    raise SystemExit(reply["code"])  # its traceback is in the job's log, written by the child


def _wait_while_starting(path: str, pid: str | None) -> None:
    """Until the server listens on ``path``, while its process ``pid`` is alive (at most START_WAIT_S)."""
    if not pid or not pid.isdigit():
        return
    deadline = time.monotonic() + START_WAIT_S
    while not os.path.exists(path) and running(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _code_digest() -> str:
    from fedhisto.infra.code_identity import source_digest

    return source_digest()


# --------------------------------------------------------------------------------------------- child side
_REPLIED = threading.Event()  # set in a child once its reply is sent: the job closing the socket then is the end


def _watch_client(conn: socket.socket) -> None:
    """End this child the moment its job process is gone (the socket closes): a killed job kills its work.
    Not once the reply is sent: the child is exiting, and a SIGKILL would read as a killed job."""
    try:
        while conn.recv(1 << 12):
            pass
    except OSError:
        pass
    if not _REPLIED.is_set():
        os.kill(os.getpid(), signal.SIGKILL)


def _reseed_global_generators() -> None:
    """Fresh entropy for the unseeded global generators, as a fresh process gets (torch seeds its default
    generator from the OS at start-up): a fork would otherwise hand every child the server's one state."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for target_fd, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threading.Thread(target=_watch_client, args=(conn,), daemon=True).start()
    _reseed_global_generators()
    from fedhisto.infra.job_logging import setup_logging
    from fedhisto.infra.progress import disable_bars

    disable_bars()
    setup_logging(request["log_path"], append=True)
    try:
        args, kwargs = pickle.loads(request["call"])
        value = _resolve(request["target"])(*args, **kwargs)
        reply: dict[str, Any] = {"status": "ok", "value": value}
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        reply = {"status": "exit", "code": code} if code else {"status": "ok", "value": None}
    except BaseException as exc:
        logging.getLogger("fedhisto").error("stage failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        reply = {"status": "exit", "code": 1}
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    _REPLIED.set()
    try:
        _send(conn, reply)
    except (pickle.PicklingError, TypeError, AttributeError):  # an unpicklable return value: the job still ends
        _send(conn, {"status": "ok", "value": None})
    return 0 if reply["status"] == "ok" else int(reply["code"])


# --------------------------------------------------------------------------------------------- server side
def serve(socket_path: str, parent_pid: int | None, preload: tuple[str, ...] = PRELOAD, idle_s: float = 0.5) -> None:
    """Import ``preload``, listen on ``socket_path``, fork one child per request until told to stop or until
    ``parent_pid`` is gone."""
    code = _code_digest()  # before the imports: an edit during them makes jobs run cold, never on stale code
    for name in preload:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".tmp")
    os.chmod(socket_path + ".tmp", 0o600)
    server.listen(64)
    os.replace(socket_path + ".tmp", socket_path)  # a client connects only once the server listens
    log.info("warm server %d listening on %s (preloaded %s)", os.getpid(), socket_path, ", ".join(preload))
    try:
        while True:
            _reap(os.path.dirname(socket_path))
            if parent_pid is not None and not _alive(parent_pid):
                log.info("warm server: parent %d is gone, stopping", parent_pid)
                return
            ready, _, _ = select.select([server], [], [], idle_s)
            if ready and _serve_one(server, code):
                return
    finally:
        server.close()
        Path(socket_path).unlink(missing_ok=True)


def _serve_one(server: socket.socket, code: str) -> bool:
    """Answer one connection: fork its job, tell it to run cold, or (True) stop. Never raises: a bad request
    costs that job its warm start, not the server."""
    conn, _ = server.accept()
    fds: list[int] = []
    try:
        request, fds = _recv(conn, with_fds=3)
        if request.get("target") == _SHUTDOWN:
            return True
        if request.get("code") != code:
            _send(conn, {"status": "cold", "why": "the package's code changed since the warm server started"})
            return False
        pid = os.fork()
        if pid == 0:  # the child: never returns into the server's loop
            status = 1
            try:
                server.close()
                _send(conn, {"status": "started", "pid": os.getpid()})
                status = _run_child(conn, request, fds)
            finally:
                os._exit(status)
        log.info(STARTED_LINE, request["target"], request.get("client_pid"), pid, request.get("log_path"),
                 request.get("client_cpu_s", float("nan")))
    except Exception as exc:
        log.warning("warm server: request not served (%s: %s); its job runs in its own process",
                    type(exc).__name__, exc)
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()
    return False


def _reap(folder: str | None = None) -> None:
    """Reap ended children; one ended by a signal (the OOM killer's SIGKILL) leaves a note in ``folder``
    for its job, which waits on the socket and cannot see the exit status itself."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        how = death_note(folder, pid, status, usage.ru_maxrss)
        log.info(ENDED_LINE, pid, how, usage.ru_maxrss / 2 ** 20, usage.ru_utime, usage.ru_stime)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_server(log_file: str | Path | None = None) -> str | None:
    """Start a warm server for this process's jobs and name it in ``FEDHISTO_WARM_SOCKET`` (its process in
    ``FEDHISTO_WARM_PID``: a job that starts before it listens waits for it); returns the socket path
    (``None`` when ``FEDHISTO_WARM=0``). It does not wait itself."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if os.environ.get(ENV_SOCKET):  # a server started around this run (a test, a wrapper) serves its jobs
        return os.environ[ENV_SOCKET]
    folder = tempfile.mkdtemp(prefix="fedhisto-warm-")  # mode 0700: only this user reaches the socket
    path = os.path.join(folder, "socket")
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        server = subprocess.Popen([sys.executable, "-m", "fedhisto.infra.warm_server", "serve", "--socket", path, "--parent",
                                   str(os.getpid())], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  start_new_session=True)
    finally:
        if log_file:
            out.close()
    os.environ[ENV_SOCKET], os.environ[ENV_PID] = path, str(server.pid)
    _STARTED.append(path)
    _PROCESSES[path] = server
    return path


def stop_server() -> None:
    """Stop the server :func:`start_server` started here (children still running finish their jobs)."""
    if not _STARTED:
        return
    path = _STARTED.pop()
    os.environ.pop(ENV_SOCKET, None)
    os.environ.pop(ENV_PID, None)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            _send(conn, {"target": _SHUTDOWN}, [0, 1, 2])
    except OSError:
        pass  # not listening yet, or gone: it also stops when its parent ends
    deadline = time.monotonic() + 5
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    process = _PROCESSES.pop(path, None)
    # reaped here, its CPU (and its jobs') counts in this process's children as a cold job's does: `/usr/bin/time
    # snakemake ...` then sees the whole run. One still busy stops on its own once this process is gone.
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedhisto.infra.warm_server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run a warm server (the Snakefile's onstart starts one)")
    s.add_argument("--socket", required=True)
    s.add_argument("--parent", type=int, default=None, help="stop when this process is gone")
    s.add_argument("--preload", nargs="*", default=list(PRELOAD), help="modules to import before listening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally block removes the socket
    serve(args.socket, args.parent, tuple(args.preload))
    # done: skip the interpreter's teardown of torch and the preloaded modules (seconds, which the Snakemake run
    # that stops this server would wait for); its log is flushed and it holds nothing else
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
