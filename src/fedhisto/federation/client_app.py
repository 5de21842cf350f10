"""The ClientApp: each message type goes to ``handlers.handle`` (what a site does with it); a stage of
Flower's SecAgg+ workflow goes to Flower's ``secaggplus_mod`` (``secure_site``).

Stock Flower runs this in one ``flwr-clientapp`` process per message (the SuperNode's SuperExec starts
it), or in a Simulation Engine worker. This module imports only flwr at load time; the handler (torch,
the model code, the site's images) is imported when the first message arrives.
"""

from __future__ import annotations

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def dispatch(action: str, content: RecordDict, node_config: dict, run_config: dict,
             state: RecordDict | None = None) -> RecordDict:
    from fedhisto.federation.handlers import handle

    return handle(action, content, node_config, run_config, state)


def _reply(msg: Message, context: Context) -> Message:
    # the run's context state: where a site keeps its terms between secure-aggregation messages
    content = dispatch(msg.metadata.message_type, msg.content, dict(context.node_config), dict(context.run_config),
                       context.state)
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.train("pre")
def train_pre(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fedhisto.federation.secure_site import is_secagg_stage, secagg_stage

    if is_secagg_stage(msg):  # a stage of Flower's SecAgg+ workflow: Flower's own client mod answers it
        return secagg_stage(msg, context)
    return _reply(msg, context)


@app.query("statistics")
def query_statistics(msg: Message, context: Context) -> Message:
    from fedhisto.federation.secure_site import answer_statistics

    return Message(answer_statistics(msg.content, dict(context.node_config), context.state), reply_to=msg)


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
