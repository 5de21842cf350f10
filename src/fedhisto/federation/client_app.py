"""The ClientApp: each message type goes to ``handlers.handle`` (what a site does with it).

A SuperNode starts one ``flwr-clientapp`` process per message, so this module imports only flwr and
the standard library: with a site worker (node config ``worker``: the socket of
``federation.worker``, which ``fedhisto site`` starts next to the SuperNode) the message is handed
to that long-lived process and this process never imports torch; without one (the Simulation
Engine, tests, ``fedhisto site --no-worker``) the handler runs here. A worker that cannot be reached
is not silent: the message is handled here instead and the reply's ``info`` record says why
(``worker-fallback``), which the server logs.
"""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def _handle_here(action: str, content: RecordDict, node_config: dict, run_config: dict) -> RecordDict:
    from fedhisto.federation.handlers import handle

    return handle(action, content, node_config, run_config)


def dispatch(action: str, content: RecordDict, node_config: dict, run_config: dict) -> RecordDict:
    socket_path = str(node_config.get("worker", ""))
    if not socket_path:
        return _handle_here(action, content, node_config, run_config)
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    from fedhisto.federation.envelope import annotate
    from fedhisto.federation.worker import WorkerUnavailable, call

    t0 = time.perf_counter()
    try:
        body, header = call(socket_path, action, recorddict_to_proto(content).SerializeToString(), node_config,
                            run_config)
    except WorkerUnavailable as exc:
        return annotate(_handle_here(action, content, node_config, run_config), **{"worker-fallback": str(exc)[:500]})
    if "refused" in header:
        return RecordDict({"error": ConfigRecord({"type": "WorkerRefused", "message": str(header["refused"]),
                                                  "traceback": ""})})
    reply = recorddict_from_proto(ProtoRecordDict.FromString(body))
    return annotate(reply, **{"worker-served": int(header["served"]), "forward_s": round(time.perf_counter() - t0, 4)})


def _reply(msg: Message, context: Context) -> Message:
    content = dispatch(msg.metadata.message_type, msg.content, dict(context.node_config), dict(context.run_config))
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.train("pre")
def train_pre(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.evaluate("post")
def evaluate_post(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.evaluate("predict")
def evaluate_predict(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.evaluate("split")
def evaluate_split(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


__all__ = ["app", "dispatch"]
