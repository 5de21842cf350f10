"""The ClientApp: a site's method hooks on the site's own data, addressed by message type.

=====================  ==========================================================================
message type           what the site does (``site.Site``)
=====================  ==========================================================================
``query``              tells its site id and identity (stain descriptor, encoder digest, code identity)
``train.pre``          ``upload_before_training`` from the start state (FedStain's style statistics)
``train``              ``local_train`` from the start state with the method payload; returns the
                       trainable state, its sample count and losses
``evaluate.post``      with the new global state: ``upload_after_aggregation`` (prototypes) and/or,
                       at the evaluation site, the validation macro-F1 of every member
``evaluate.predict``   evaluation site only: validation probabilities of the best members
=====================  ==========================================================================

Every message carries a ``run`` ConfigRecord (method, seed, the run's config as JSON, round, the
site it is meant for and the site's index k in the sorted site list, which seeds its random
streams). A site refuses a message meant for another site. A ``ClientUnavailable`` (the site's data
cannot be read) or any other exception is returned as an ``error`` record with its type, so the
server applies the engine's rules (tolerated and counted vs. the run stops and names the site).
"""

from __future__ import annotations

import os
import traceback

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhisto.code_identity import identity_strings
from fedhisto.federation.records import (
    get_members,
    get_payload,
    get_value,
    put_value,
    record_state,
    state_record,
)
from fedhisto.federation.site import Site, SiteConfig

app = ClientApp()


def _site(msg: Message, context: Context) -> tuple[Site, dict]:
    run = dict(msg.content["run"])
    sc = SiteConfig.from_node_config(dict(context.node_config), dict(context.run_config))
    if run.get("site") and str(run["site"]) != sc.site:
        raise RuntimeError(f"message meant for site {run['site']} reached site {sc.site}")
    return Site(sc, str(run["config"]), str(run["method"]), int(run["seed"])), run


def _reply(msg: Message, fn) -> Message:
    """Run one handler; exceptions travel back as an ``error`` record (type, message, traceback)."""
    try:
        content = fn()
    except Exception as exc:
        content = RecordDict({"error": ConfigRecord({"type": type(exc).__name__, "message": str(exc)[:2000],
                                                     "traceback": traceback.format_exc()[-4000:]})})
    content["info"] = ConfigRecord({"pid": os.getpid()})
    return Message(content, reply_to=msg)


@app.query()
def hello(msg: Message, context: Context) -> Message:
    def fn() -> RecordDict:
        site, _ = _site(msg, context)
        ident = site.identity()
        rd = RecordDict({"site": ConfigRecord({"site-id": site.sc.site, "encoder-digest": ident["encoder_digest"]}),
                         "code": ConfigRecord(identity_strings())})  # code_identity.check_code on the server
        put_value(rd, "descriptor", ident["descriptor"])
        return rd

    return _reply(msg, fn)


@app.train("pre")
def pre(msg: Message, context: Context) -> Message:
    def fn() -> RecordDict:
        site, run = _site(msg, context)
        upload = site.upload_before_training(record_state(msg.content["start"]), int(run["round"]), int(run["k"]))
        rd = RecordDict()
        put_value(rd, "upload", upload)
        return rd

    return _reply(msg, fn)


@app.train()
def train(msg: Message, context: Context) -> Message:
    def fn() -> RecordDict:
        site, run = _site(msg, context)
        ident = site.identity()
        result = site.train(record_state(msg.content["start"]), get_payload(msg.content), int(run["round"]),
                            int(run["k"]))
        rd = RecordDict({"state": state_record(result.state),
                         "metrics": MetricRecord({"num-examples": int(result.n_samples), "steps": int(result.steps)}),
                         "losses": MetricRecord({k: float(v) for k, v in result.losses.items()}),
                         "identity": ConfigRecord({"encoder-digest": ident["encoder_digest"]}),
                         "code": ConfigRecord(identity_strings())})  # deployment has no query: checked here
        put_value(rd, "descriptor", ident["descriptor"])  # the server checks it against the run identity
        return rd

    return _reply(msg, fn)


@app.evaluate("post")
def post(msg: Message, context: Context) -> Message:
    def fn() -> RecordDict:
        site, run = _site(msg, context)
        members = get_members(msg.content)
        rd = RecordDict()
        if run.get("validate"):
            rd["validation"] = MetricRecord({k: float(v) for k, v in site.validate(members).items()})
        if run.get("upload"):
            put_value(rd, "upload", site.upload_after_aggregation(members[str(run["member"])]))
        return rd

    return _reply(msg, fn)


@app.evaluate("predict")
def predict_validation(msg: Message, context: Context) -> Message:
    def fn() -> RecordDict:
        site, _ = _site(msg, context)
        probs = site.predict_validation(get_members(msg.content))
        val = site.validation()
        rd = RecordDict({"samples": ConfigRecord({"ids": list(val.ids), "labels": [int(y) for y in val.labels]})})
        for name, p in probs.items():
            put_value(rd, f"probs:{name}", p)
        return rd

    return _reply(msg, fn)


__all__ = ["app", "get_value"]
