"""A site's long-lived worker (fast path: it replaces Flower's per-message ClientApp process), so torch,
the model and the site's decoded images are loaded once per node instead of once per message.

Why: a Flower 1.42 SuperNode starts one ``flwr-clientapp`` process per message (its SuperExec
launches it; ``flwr/supernode/runtime/run_clientapp.py`` handles exactly one message and exits), and
a process that imports torch, transformers and peft, builds the encoder and decodes the site's
images spends seconds before its first useful operation (measured in docs/federation.md). With a
worker the ``flwr-clientapp`` the SuperExec starts is ``clientapp_launcher``, which imports only the
standard library and hands the whole task to this process (:func:`run_task`, Flower 1.42's
``run_clientapp`` re-implemented here). :func:`forward` hands one message's RecordDict (Flower's own
protobuf serialisation) over the Unix socket instead, for a caller that holds the message already
(tests' in-process Grid).

Lifetime: started by ``fedhisto site --fastpath`` next to the SuperNode and
stopped with it: it exits when its parent process ends (``--parent-pid``), on SIGTERM/SIGINT, or
when told to by nobody else. Isolation: one worker per site; it serves only the node config it
was started with (a request naming another site, manifest, descriptors or encoder folder is refused
as an error reply), one message at a time (a SuperNode handles one message at a time anyway); its
socket lives in a directory only the site's user can enter (mode 0700, socket 0600). It holds the
same per-process caches a warm Simulation Engine worker holds (``site._MODELS``/``_DATA``) and
nothing else between messages; every reply is computed by ``handlers.handle``, the function the
ClientApp calls in-process, so the reply is the same either way.

Warm-up (``--warm-config``, ``fedhisto site --warm-config``): the worker knows its node config when
it starts, so before it writes its ready file it builds the frozen encoder (from the node's encoder
file when there is one: ``encoder_cache``), decodes the site's images and, per ``--warm-run``, builds
the run's model, into the same caches the first message would fill (``site.warm_up``). That moves
round 1's model build and decode into the deployment's start-up, once per deployment; replies do not
change (a warmed worker's replies are an unwarmed one's, bit for bit: tests/test_flower.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

AUDIT_VAR = "FEDHISTO_OPEN_AUDIT"  # a folder: the worker records every path it opens there (tests)
_OPENED: list[str] = []

# node-config keys that pin what a worker serves (a request with other values is refused)
PINNED = ("site-id", "manifest", "descriptors", "encoder-dir", "cache-dir", "report")
_LEN = struct.Struct(">Q")


class WorkerUnavailable(RuntimeError):
    """The site's worker cannot be reached (not started, died, or its socket is stale)."""


def _send(sock: socket.socket, header: dict, body: bytes) -> None:
    head = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(head)) + head + _LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict, bytes]:
    header = json.loads(_recv_exact(sock, _LEN.unpack(_recv_exact(sock, _LEN.size))[0]))
    body = _recv_exact(sock, _LEN.unpack(_recv_exact(sock, _LEN.size))[0])
    return header, body


# ------------------------------------------------------------------ the ClientApp's side
def call(socket_path: str, action: str, content: bytes, node_config: dict, run_config: dict,
         timeout: float | None = None) -> tuple[bytes, dict]:
    """Hand one message (serialised RecordDict) to the worker; returns (reply bytes, worker header)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise WorkerUnavailable(f"no site worker at {socket_path}: {exc}") from exc
        _send(sock, {"action": action, "node_config": node_config, "run_config": run_config}, content)
        try:
            header, body = _recv(sock)
        except (OSError, ConnectionError, ValueError) as exc:
            raise WorkerUnavailable(f"the site worker at {socket_path} did not answer: {exc}") from exc
    finally:
        sock.close()
    return body, header


def forward(socket_path: str, action: str, content, node_config: dict, run_config: dict):
    """One message's RecordDict handled by the worker at ``socket_path``: the reply's RecordDict, its
    ``info`` record marking the worker (``worker-served``, ``forward_s``); an ``error`` record when the
    worker refused the request. Raises :class:`WorkerUnavailable` when no worker answers."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    from fedhisto.federation.envelope import annotate

    t0 = time.perf_counter()
    body, header = call(socket_path, action, recorddict_to_proto(content).SerializeToString(), node_config,
                        run_config)
    if "refused" in header:
        return RecordDict({"error": ConfigRecord({"type": "WorkerRefused", "message": str(header["refused"]),
                                                  "traceback": ""})})
    reply = recorddict_from_proto(ProtoRecordDict.FromString(body))
    return annotate(reply, **{"worker-served": int(header["served"]), "forward_s": round(time.perf_counter() - t0, 4)})


def call_task(socket_path: str, args: dict) -> int:
    """Hand a whole Flower task (token, runtime API address, TLS) to the worker; its exit code."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(socket_path)
        except OSError as exc:
            raise WorkerUnavailable(f"no site worker at {socket_path}: {exc}") from exc
        _send(sock, dict(args), b"")
        try:
            header, _ = _recv(sock)
        except (OSError, ConnectionError, ValueError) as exc:  # the task's token is spent: no second try
            print(f"fedhisto: the site worker at {socket_path} did not finish the task: {exc}", file=sys.stderr)
            return 1
    finally:
        sock.close()
    return int(header.get("exit_code", 1))


# ------------------------------------------------------------------ a Flower task run in the worker
def run_task(token: str, runtime_api_address: str, insecure: bool, root_certificates: str | None,
             pinned: dict[str, str]) -> int:
    """What ``flwr-clientapp --token`` does for one task (Flower 1.42's
    ``flwr.supernode.runtime.run_clientapp.run_clientapp``: pull the message and context from the
    SuperNode's runtime API, run the app, push the reply and the task output, with the task
    heartbeat running), in this long-lived process and without that function's process-level parts
    (signal handlers, parent monitor, ``sys.exit``). The app is this package's ClientApp, handled
    by ``handlers.handle`` here; the FAB the SuperNode hands over must name it, else the task fails.
    Returns the exit code ``flwr-clientapp`` would have returned."""
    import tomllib

    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.exit import ExitCode
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.runtime.tracing import RuntimeTracingInterceptor
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    from fedhisto.federation.envelope import annotate
    from fedhisto.federation.fastpath.fast_pull import patch as fast_pulls
    from fedhisto.federation.handlers import handle

    fast_pulls()  # pull_task_input's object pulls retry after 0.05 s, not 1 s (fast_pull)

    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address, insecure=insecure,
        root_certificates=validate_and_resolve_root_certificates(root_certificates, insecure),
        interceptors=[RuntimeTracingInterceptor(), RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                      RuntimeTokenHttpInterceptor(token)],
        retry_invoker=make_simple_http_retry_invoker())
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    message = reply = context = None
    sub_status, details, code = SubStatus.FAILED, "ClientApp task failed due to unknown reason", ExitCode.SUCCESS
    marks = {"task_start_unix": time.time()}
    try:
        heartbeat.start()
        message, context, _run, fab = _pull_task_input(client, marks)
        marks["pulled_unix"] = time.time()
        _check_fab(fab.content, tomllib)
        theirs = _pinned(dict(context.node_config))
        if theirs != pinned:
            raise RuntimeError(f"this worker serves site {pinned['site-id']}; the task's node config differs in "
                               f"{', '.join(sorted(k for k in PINNED if theirs[k] != pinned[k]))}")
        content = handle(message.metadata.message_type, message.content, dict(context.node_config),
                         dict(context.run_config))
        content = annotate(content, **{"worker-task": 1}, **{k: round(v, 4) for k, v in marks.items()})
        reply = Message(content, reply_to=message)
        sub_status, details = SubStatus.COMPLETED, ""
    except Exception as exc:
        details = f"{type(exc)}:<'{exc}'>"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
        code = ExitCode.TASK_PROC_EXCEPTION
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception:
            code = ExitCode.CLIENTAPP_COMMUNICATION_ERROR
        t_push = time.time()
        push_task_output(client=client, context=context, sub_status=sub_status, details=details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
        # one line per task in the worker's log: where its seconds went (unix times)
        print(f"task {message.metadata.message_type if message else '?'}: start {marks['task_start_unix']:.2f} "
              f"input {marks.get('input_unix', 0):.2f} listed {marks.get('listed_unix', 0):.2f} "
              f"pulled {marks.get('pulled_unix', 0):.2f} pushed {t_push:.2f} done {time.time():.2f} "
              f"exit {int(code)}", file=sys.stderr, flush=True)
    return int(code)


def _pull_task_input(client, marks: dict):
    """Flower 1.42's ``run_clientapp.pull_task_input`` (context, run and FAB; the message list; the
    message's objects), with the time of each of its three steps in ``marks``."""
    import flwr.supernode.runtime.run_clientapp as rc  # the names Flower's own function uses

    res = client.PullTaskInput(rc.PullTaskInputRequest())
    marks["input_unix"] = time.time()
    rc.TaskIdentity.task_id, rc.TaskIdentity.run_id, rc.TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = rc.context_from_proto(res.context), rc.run_from_proto(res.run), rc.fab_from_proto(res.fab)
    listed = client.PullMessages(rc.PullAppMessagesRequest())
    marks["listed_unix"] = time.time()
    if not listed.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node, tree = rc.Node(node_id=context.node_id), listed.message_object_trees[0]
    message = rc.pull_and_inflate_object_from_tree(
        tree, rc.make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        rc.make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=rc.Message)
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower's: the deflated message lacks it
    return message, context, run, fab


def _check_fab(fab_bytes: bytes, tomllib) -> None:
    """The run's app must be this package's ClientApp (the worker runs nothing else)."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(fab_bytes)) as z:
        names = sorted((n for n in z.namelist() if n.endswith("pyproject.toml")), key=lambda n: n.count("/"))
        if not names:
            raise RuntimeError("the run's app (FAB) has no pyproject.toml")
        doc = tomllib.loads(z.read(names[0]).decode())
    comp = doc.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {}).get("clientapp")
    if comp != "fedhisto.federation.client_app:app":
        raise RuntimeError(f"this site worker runs only fedhisto's ClientApp, the run's app names {comp!r}")


# ------------------------------------------------------------------ the worker
def _pinned(node_config: dict) -> dict[str, str]:
    return {k: str(node_config.get(k, "")) for k in PINNED}


def _watch_parent(parent_pid: int, on_exit) -> None:
    def loop() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                on_exit()
                return
            if os.getppid() != parent_pid:  # reparented: the parent is gone
                on_exit()
                return
            time.sleep(1.0)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def _record_opens() -> None:
    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], str | bytes | os.PathLike) and len(_OPENED) < 200_000:
            _OPENED.append(os.path.realpath(os.fsdecode(args[0])))

    sys.addaudithook(hook)


def _dump_opens(site: str) -> None:
    folder = os.environ.get(AUDIT_VAR)
    if folder:
        path = Path(folder) / f"worker_open_audit.{site}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "site": site, "opened": sorted(set(_OPENED))}))
        os.replace(tmp, path)


def serve(socket_path: str, node_config: dict, parent_pid: int | None = None, ready_file: str | None = None,
          warm: dict | None = None) -> None:
    """Answer messages on ``socket_path`` until the parent ends or a signal arrives. ``warm``
    (``config``: the federation's config file; ``splits``; ``runs``: ``(method, seed)`` pairs):
    load the encoder, images and models first (``site.warm_up``), before the ready file is written."""
    if os.environ.get(AUDIT_VAR):
        _record_opens()
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    from fedhisto.federation.handlers import handle  # torch, peft, the model code: once, here

    path = Path(socket_path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    if path.exists() or path.is_socket():
        path.unlink()  # a dead worker's socket; this worker replaces whatever held the path
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o600)
    server.listen(4)
    pinned = _pinned(node_config)

    def stop(*_args) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if parent_pid:
        _watch_parent(parent_pid, stop)
    warmed = _warm(node_config, warm) if warm else {}
    if ready_file:
        Path(ready_file).write_text(json.dumps({"pid": os.getpid(), "socket": str(path), "warmed": warmed}))
    served = 0
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                header, body = _recv(conn)
            except (OSError, ConnectionError, ValueError):
                continue
            try:  # one bad request (or a caller gone before the reply) never ends the worker
                served += 1
                out_header, out_body = _answer(header, body, pinned, served, handle, recorddict_from_proto,
                                               recorddict_to_proto, ProtoRecordDict)
            except Exception as exc:
                out_header, out_body = {"refused": f"site {pinned['site-id']} worker: {type(exc).__name__}: {exc}"}, b""
            with contextlib.suppress(OSError):
                _send(conn, out_header, out_body)


def _warm(node_config: dict, warm: dict) -> dict:
    """The warm-up (``site.warm_up``) of the node config this worker serves; its seconds go to the log."""
    from fedhisto.config.study import load_config_file
    from fedhisto.federation.site import BUILT, SiteConfig, warm_up

    t0 = time.perf_counter()
    sc = SiteConfig.from_node_config(node_config, {})
    done = warm_up(sc, load_config_file(str(warm["config"])), tuple(warm.get("splits", ("optimisation",))),
                   tuple((str(m), int(s)) for m, s in warm.get("runs", ())))
    done["total"] = round(time.perf_counter() - t0, 3)
    done["built"] = dict(BUILT)  # what warm-up built or decoded itself (not read from the node's cache)
    print(f"site {sc.site} worker warmed up: {json.dumps(done)}", file=sys.stderr, flush=True)
    return done


def _answer(header: dict, body: bytes, pinned: dict, served: int, handle, from_proto, to_proto, proto_cls
            ) -> tuple[dict, bytes]:
    t0 = time.perf_counter()
    if "token" in header:  # a whole Flower task, handed over by ``clientapp_launcher``
        code = run_task(str(header["token"]), str(header["runtime_api_address"]), bool(header["insecure"]),
                        header.get("root_certificates"), pinned)
        _dump_opens(pinned["site-id"])
        return {"exit_code": code, "served": served, "worker_s": round(time.perf_counter() - t0, 4)}, b""
    theirs = _pinned(header.get("node_config", {}))
    if theirs != pinned:
        differ = sorted(k for k in PINNED if theirs[k] != pinned[k])
        return {"refused": f"this worker serves site {pinned['site-id']} with its own node config; "
                           f"the request differs in {', '.join(differ)}"}, b""
    content = from_proto(proto_cls.FromString(body))
    reply = handle(str(header["action"]), content, dict(header["node_config"]), dict(header["run_config"]))
    _dump_opens(pinned["site-id"])
    return ({"served": served, "pid": os.getpid(), "worker_s": round(time.perf_counter() - t0, 4)},
            to_proto(reply).SerializeToString())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="a site's long-lived message worker (started by `fedhisto site --fastpath`)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--node-config", required=True, help="JSON object: the SuperNode's node config")
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--warm-config", help="the federation's config file: load the frozen encoder and the site's "
                                          "images (and the --warm-run models) before saying ready")
    ap.add_argument("--warm-splits", default="optimisation",
                    help="comma list of the splits to decode at warm-up (the evaluation site: add validation)")
    ap.add_argument("--warm-run", action="append", default=[], metavar="METHOD:SEED",
                    help="also build this run's model at warm-up (repeatable)")
    args = ap.parse_args(argv)
    from fedhisto.federation.fastpath import FastpathUnsupported, require

    try:
        require()
    except FastpathUnsupported as exc:
        raise SystemExit(f"fedhisto site worker: {exc}") from None
    warm = None
    if args.warm_config:
        warm = {"config": args.warm_config, "splits": [s.strip() for s in args.warm_splits.split(",") if s.strip()],
                "runs": [parse_warm_run(r) for r in args.warm_run]}
    elif args.warm_run:
        ap.error("--warm-run needs --warm-config (the model is built from the federation's config)")
    serve(args.socket, json.loads(args.node_config), args.parent_pid, args.ready_file, warm)


def parse_warm_run(text: str) -> tuple[str, int]:
    method, sep, seed = text.rpartition(":")
    if not sep or not method or not seed.isdigit():
        raise SystemExit(f"--warm-run {text!r}: expected METHOD:SEED, e.g. past_v2:11")
    return method, int(seed)


if __name__ == "__main__":
    main(sys.argv[1:])
