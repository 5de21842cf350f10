"""What a site does with each message type, on RecordDicts and without a Flower ``Message``.

The ClientApp (``client_app``) calls :func:`handle` in its own process; the opt-in long-lived site
worker calls the same function: one implementation, so a worker's reply is the in-process reply (the
bitwise tests run through both).

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
``evaluate.split``     federated evaluation (``federation.evaluate``): one of the site's evaluation
                       splits under the given members, as per-image rows or as counts and bins
=====================  ==========================================================================

Every message carries a ``run`` ConfigRecord (method, seed, the run's config as JSON, round, the
site it is meant for and the site's index k in the sorted site list, which seeds its random
streams). A site refuses a message meant for another site. A ``ClientUnavailable`` (the site's data
cannot be read) or any other exception is returned as an ``error`` record with its type, so the
server applies the engine's rules (tolerated and counted vs. the run stops and names the site).
Every reply has an ``info`` record: the process id, where the message's seconds went, and how many
encoders, models and images the process has built or decoded so far (``site.BUILT``).
"""

from __future__ import annotations

import json
import os
import time
import traceback

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedhisto.federation.envelope import is_sealed, seal, unseal
from fedhisto.federation.records import get_members, get_payload, put_value, record_state, state_record
from fedhisto.federation.site import BUILT, Site, SiteConfig
from fedhisto.infra.code_identity import identity_strings


def _site(content: RecordDict, node_config: dict, run_config: dict) -> tuple[Site, dict]:
    run = dict(content["run"])
    sc = SiteConfig.from_node_config(node_config, run_config)
    if run.get("site") and str(run["site"]) != sc.site:
        raise RuntimeError(f"message meant for site {run['site']} reached site {sc.site}")
    return Site(sc, str(run["config"]), str(run["method"]), int(run["seed"])), run


def hello(site: Site, run: dict, content: RecordDict) -> RecordDict:
    ident = site.identity()
    rd = RecordDict({"site": ConfigRecord({"site-id": site.sc.site, "encoder-digest": ident["encoder_digest"]}),
                     "code": ConfigRecord(identity_strings())})  # code_identity.check_code on the server
    put_value(rd, "descriptor", ident["descriptor"])
    return rd


def pre(site: Site, run: dict, content: RecordDict) -> RecordDict:
    upload = site.upload_before_training(record_state(content["start"]), int(run["round"]), int(run["k"]))
    rd = RecordDict()
    put_value(rd, "upload", upload)
    return rd


def train(site: Site, run: dict, content: RecordDict) -> RecordDict:
    ident = site.identity()
    start = record_state(content["start"])
    result = site.train(start, get_payload(content), int(run["round"]), int(run["k"]))
    rd = RecordDict({"metrics": MetricRecord({"num-examples": int(result.n_samples), "steps": int(result.steps)}),
                     "identity": ConfigRecord({"encoder-digest": ident["encoder_digest"]}),
                     "code": ConfigRecord(identity_strings())})  # deployment has no query: checked here
    if site.cfg.secure_aggregation.enabled:  # the state stays here: kept for the masked sums (secure_site)
        rd["secure"] = ConfigRecord({"layout": json.dumps(site.keep_for_masking(start, result, int(run["round"])))})
    else:
        rd["state"] = state_record(result.state)
        rd["losses"] = MetricRecord({k: float(v) for k, v in result.losses.items()})
    put_value(rd, "descriptor", ident["descriptor"])  # the server checks it against the run identity
    return rd


def post(site: Site, run: dict, content: RecordDict) -> RecordDict:
    members = get_members(content)
    rd = RecordDict()
    if run.get("validate"):  # confusion matrices: the server sums them over the sites that hold validation
        rd["validation-counts"] = ConfigRecord({"json": json.dumps(site.validation_counts(members))})
    if run.get("upload"):
        upload = site.upload_after_aggregation(members[str(run["member"])])
        if site.cfg.secure_aggregation.enabled:  # kept for the post-aggregation masked sum
            rd["secure"] = ConfigRecord({"layout": json.dumps(site.keep_post_for_masking(upload, int(run["round"])))})
        else:
            put_value(rd, "upload", upload)
    return rd


def predict_validation(site: Site, run: dict, content: RecordDict) -> RecordDict:
    probs = site.predict_validation(get_members(content))
    val = site.validation()
    rd = RecordDict({"samples": ConfigRecord({"ids": list(val.ids), "labels": [int(y) for y in val.labels]})})
    for name, p in probs.items():
        put_value(rd, f"probs:{name}", p)
    return rd


def evaluate_split(site: Site, run: dict, content: RecordDict) -> RecordDict:
    from fedhisto.federation.evaluate import site_evaluation

    return site_evaluation(site, run, content)


HANDLERS = {"query": hello, "train.pre": pre, "train": train, "evaluate.post": post,
            "evaluate.predict": predict_validation, "evaluate.split": evaluate_split}


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; -1 elsewhere): in a per-message ClientApp
    process, the interpreter start and imports paid before the handler runs."""
    try:
        with open("/proc/self/stat") as fh:
            started = int(fh.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as fh:
            return float(fh.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return -1.0


def handle(action: str, content: RecordDict, node_config: dict, run_config: dict,
           state: RecordDict | None = None) -> RecordDict:
    """One message; exceptions travel back as an ``error`` record (type, message, traceback). A sealed
    request (``records.seal``) gets a sealed reply. ``state``: the run's ``Context.state`` (stock
    Flower), where a site keeps its terms under secure aggregation; None in the fast path's worker."""
    if is_sealed(content):
        return seal(handle(action, unseal(content), node_config, run_config, state))
    t0 = time.perf_counter()
    timings: dict[str, float] = {"process_age_s": process_age_s(), "start_unix": time.time()}
    try:
        if "secaggplus_configs" in content.config_records:  # only client_app routes these, with its Context
            raise RuntimeError("a stage of Flower's SecAgg+ reached a process without Flower's Context (the fast "
                               "path's site worker): secure aggregation runs on stock Flower processes (fedhisto "
                               "site without the fast path)")
        if action not in HANDLERS:
            raise ValueError(f"unknown message type {action!r}")
        site, run = _site(content, node_config, run_config)
        site.kept_state = state
        timings["setup_s"] = time.perf_counter() - t0  # model build and descriptors (cached when warm)
        reply = HANDLERS[action](site, run, content)
    except Exception as exc:
        reply = RecordDict({"error": ConfigRecord({"type": type(exc).__name__, "message": str(exc)[:2000],
                                                   "traceback": traceback.format_exc()[-4000:]})})
    timings["handler_s"] = time.perf_counter() - t0
    timings["end_unix"] = time.time()
    reply["info"] = ConfigRecord({"pid": os.getpid(), **{k: round(v, 4) for k, v in timings.items()}, **BUILT})
    return reply
