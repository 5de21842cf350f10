"""The ClientApp: each message type goes to ``handlers.handle`` (what a site does with it).

Stock Flower runs this in one ``flwr-clientapp`` process per message (the SuperNode's SuperExec starts
it), or in a Simulation Engine worker. This module imports only flwr at load time; the handler (torch,
the model code, the site's images) is imported when the first message arrives.
"""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def dispatch(action: str, content: RecordDict, node_config: dict, run_config: dict) -> RecordDict:
    from fedhisto.federation.handlers import handle

    return handle(action, content, node_config, run_config)


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
