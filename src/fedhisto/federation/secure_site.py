"""A site's half of secure aggregation on Flower: what it keeps between messages, and what it masks.

After training (``train`` under ``secure_aggregation.enabled``) the site does not send its state: it
keeps its terms (``Objective.secure_terms``, and for statistics weights its update ``secure_statistic``)
in the ClientApp's ``Context.state``, the record Flower's SuperNode keeps for a run between messages,
and answers its sample count, step count and the terms' layout. Then:

- a **SecAgg+ stage** (a ``train`` message carrying ``secaggplus_configs``, sent by the ServerApp's
  ``SecAggPlusWorkflow``) goes through Flower's own ``secaggplus_mod``; at its ``collect_masked_vectors``
  stage the mod calls :func:`contribution`, which returns ``weight * terms`` (the weight the server
  assigned, sent in the stage's instructions) as a legacy ``FitRes`` with ``num_examples = 1``; the
  mod quantises, masks and sends it;
- ``query.statistics`` (statistics weights): the site receives the masked sum S of every site's update
  and states D_k . S and ||D_k||^2.

Everything here runs on NumPy from the kept arrays (a product is expanded when masked): a SecAgg+
stage's ClientApp process imports no torch. The fast path's site worker has no ``Context`` and refuses.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

KEPT = "fedhisto-kept"
PACKED, LAYOUT = "packed", "packed#layout"  # records.state_record's array names (records imports torch)


class NotKept(RuntimeError):
    """A masked sum asked for terms this site does not hold for the round (restarted, or another run)."""


def keep(state: RecordDict | None, key: str, round_idx: int, terms: dict) -> list[list]:
    """Store a site's terms (tensors, or ``fedmath.secure_sums.Product`` kept as their factors) under
    ``key`` in the run's context state; returns their layout [[name, shape], ...] (sorted names)."""
    from fedhisto.fedmath.secure_sums import Product

    if state is None:
        raise RuntimeError("secure aggregation keeps a site's terms in the ClientApp's Context between messages; "
                           "this process has none (the fast path's site worker): run the site on stock Flower "
                           "processes (fedhisto site without the fast path)")
    arrays, meta = {}, []
    for name in sorted(terms):
        t = terms[name]
        if isinstance(t, Product):
            parts = {"b": t.b, "a": t.a, **({"b0": t.b0, "a0": t.a0} if t.b0 is not None else {})}
            meta.append([name, "product", list(t.shape), float(t.scale), sorted(parts)])
        else:
            parts = {"t": t}
            meta.append([name, "tensor", list(t.shape), 1.0, ["t"]])
        for part, v in parts.items():
            arrays[f"{name}#{part}"] = np.ascontiguousarray(v.detach().cpu().numpy()).reshape(-1)
    state[f"{KEPT}:{key}"] = ArrayRecord({k: _array(v) for k, v in arrays.items()}) if arrays else ArrayRecord()
    state[f"{KEPT}:{key}#meta"] = ConfigRecord({"round": int(round_idx), "terms": json.dumps(meta)})
    return [[name, shape] for name, _, shape, _, _ in meta]


def _array(values: np.ndarray):
    from flwr.app import Array

    return Array(values)


def kept(state: RecordDict, key: str, round_idx: int) -> list[tuple[str, np.ndarray]]:
    """The kept terms of ``key`` for round ``round_idx`` as float64 arrays in layout order."""
    meta_key = f"{KEPT}:{key}#meta"
    if state is None or meta_key not in state:
        raise NotKept(f"no {key} terms kept for round {round_idx + 1} (the site restarted since it trained?)")
    meta = state[meta_key]
    if int(meta["round"]) != round_idx:
        raise NotKept(f"the kept {key} terms are round {int(meta['round']) + 1}'s, not round {round_idx + 1}'s")
    record = state[f"{KEPT}:{key}"]
    out = []
    for name, kind, shape, scale, parts in json.loads(str(meta["terms"])):
        got = {p: record[f"{name}#{p}"].numpy().astype(np.float64) for p in parts}
        if kind == "product":
            b, a = got["b"].reshape(shape[0], -1), got["a"].reshape(-1, shape[1])
            value = b @ a
            if "b0" in got:
                value = value - got["b0"].reshape(shape[0], -1) @ got["a0"].reshape(-1, shape[1])
            value = scale * value
        else:
            value = got["t"].reshape(shape)
        out.append((name, value))
    return out


def weighted(state: RecordDict, key: str, round_idx: int, weight: float, clip: float, site: str) -> list[np.ndarray]:
    """``weight * term`` of every kept term, refused by name when a value leaves [-clip, clip] (SecAgg+
    would clip it silently; ``fedmath.secure_sums.weighted_arrays`` is the in-process twin)."""
    out = []
    for name, value in kept(state, key, round_idx):
        arr = np.asarray(weight * value, dtype=np.float64)
        worst = float(np.abs(arr).max()) if arr.size else 0.0
        if not np.isfinite(arr).all() or worst > clip:
            raise ValueError(f"site {site}: term {name} weighted by {weight:.6g} reaches {worst:.6g}, outside the "
                             f"clipping range +/-{clip:g} (secure_aggregation.clipping_range)")
        out.append(arr)
    return out


# ------------------------------------------------------------------ messages
def contribution(msg: Message, context: Context) -> Message:
    """The ``call_next`` of ``secaggplus_mod`` at its collect stage: this site's weighted terms as a FitRes."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    ins = compat.recorddict_to_fitins(msg.content, keep_input=True).config
    site = str(context.node_config.get("site-id", ""))
    if str(ins["fedhisto-site"]) != site and site:
        raise RuntimeError(f"masked-sum instructions meant for site {ins['fedhisto-site']} reached site {site}")
    arrays = weighted(context.state, str(ins["fedhisto-key"]), int(ins["fedhisto-round"]),
                      float(ins["fedhisto-weight"]), float(ins["fedhisto-clip"]), site)
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, {})
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)


def is_secagg_stage(msg: Message) -> bool:
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return RECORD_KEY_CONFIGS in msg.content.config_records


def secagg_stage(msg: Message, context: Context) -> Message:
    """One SecAgg+ stage through Flower's own client mod (keys, shares, the masked vector, unmasking)."""
    from flwr.client.mod import secaggplus_mod

    return secaggplus_mod(msg, context, contribution)


def numpy_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    """A packed state record (``records.state_record``) as NumPy arrays, without torch."""
    buf = record[PACKED].numpy()
    out = {}
    for name, dtype, shape, offset, n in json.loads(bytes(record[LAYOUT].numpy()).decode()):
        out[name] = np.frombuffer(buf[offset:offset + n].tobytes(), dtype=np.dtype(dtype)).reshape(shape)
    return out


def statistics(content: RecordDict, node_config: dict, state: RecordDict | None) -> RecordDict:
    """``query.statistics``: D_k . S and ||D_k||^2 of the kept update against the masked sum S."""
    run = dict(content["run"])
    site = str(node_config.get("site-id", ""))
    if site and str(run.get("site", site)) != site:
        raise RuntimeError(f"message meant for site {run['site']} reached site {site}")
    reference = numpy_state(content["reference"])
    dot = sq = 0.0
    for name, value in kept(state, "statistic", int(run["round"])):
        ref = reference[name].astype(np.float64).reshape(value.shape)
        dot += float((value * ref).sum())
        sq += float((value * value).sum())
    return RecordDict({"statistics": MetricRecord({"dot": dot, "squared-norm": sq})})


def answer_statistics(content: RecordDict, node_config: dict, state: RecordDict | None) -> RecordDict:
    """``statistics`` as a reply: sealed as the request was, an exception as the handlers' ``error`` record."""
    import traceback

    from fedhisto.federation.envelope import is_sealed, seal, unseal

    if is_sealed(content):
        return seal(answer_statistics(unseal(content), node_config, state))
    try:
        return statistics(content, node_config, state)
    except Exception as exc:
        kind = "ClientUnavailable" if isinstance(exc, NotKept) else type(exc).__name__  # a restarted site: away
        return RecordDict({"error": ConfigRecord({"type": kind, "message": str(exc)[:2000],
                                                  "traceback": traceback.format_exc()[-4000:]})})
