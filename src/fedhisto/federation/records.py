"""What travels between the ServerApp and the ClientApps, as Flower records.

Every tensor travels as an ``ArrayRecord`` (a state dict of numpy arrays; dtype and shape round-trip
exactly, bool masks included), everything else as a ``MetricRecord`` (counts, metrics, losses) or a
``ConfigRecord`` (round, site, kinds). One encoder per kind of value our method hooks exchange:

- trainable states (LoRA A/B, adapters, FiLM, head): ``state``; the frozen encoder never travels;
- ``ServerPrototypes`` (centroids, reliability, mask, counts) and ``ClientPrototypes``;
- FedStain's ``StyleStats`` (a client's upload, and the pool the server sends back);
- stain descriptors (one vector).

A value is stored under a record-name prefix: ``{prefix}`` for its tensors and ``{prefix}#meta`` for
what it is (``kind``), so a payload dict of several values (``configure_train``'s) becomes one
RecordDict and decodes back to the same Python objects.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedhisto.fedmath.fedstain import StyleStats
from fedhisto.fedmath.prototypes import ClientPrototypes, ServerPrototypes

STYLE_FIELDS = ("pixel_mean", "pixel_std", "feat_skew", "feat_kurt")


def state_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A trainable state dict as an ArrayRecord (CPU, contiguous, same dtype)."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})


def record_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict())


def put_value(rd: RecordDict, prefix: str, value: Any) -> None:
    """Store one hook value (None, prototypes, style statistics, a tensor, a state dict) under ``prefix``."""
    if value is None:
        rd[f"{prefix}#meta"] = ConfigRecord({"kind": "none"})
    elif isinstance(value, ServerPrototypes):
        rd[prefix] = state_record(value.state())
        rd[f"{prefix}#meta"] = ConfigRecord({"kind": "server_prototypes"})
    elif isinstance(value, ClientPrototypes):
        classes = sorted(value.centroids)
        rd[prefix] = state_record({str(c): value.centroids[c] for c in classes})
        rd[f"{prefix}#counts"] = MetricRecord({str(c): int(value.counts[c]) for c in sorted(value.counts)})
        rd[f"{prefix}#meta"] = ConfigRecord({"kind": "client_prototypes"})
    elif isinstance(value, StyleStats):
        rd[prefix] = state_record({f: getattr(value, f) for f in STYLE_FIELDS})
        rd[f"{prefix}#meta"] = ConfigRecord({"kind": "style_stats"})
    elif isinstance(value, torch.Tensor):
        rd[prefix] = state_record({"value": value})
        rd[f"{prefix}#meta"] = ConfigRecord({"kind": "tensor"})
    elif isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
        rd[prefix] = state_record(value)
        rd[f"{prefix}#meta"] = ConfigRecord({"kind": "state"})
    else:
        raise TypeError(f"{prefix}: no record encoding for {type(value).__name__}")


def get_value(rd: RecordDict, prefix: str) -> Any:
    kind = str(rd[f"{prefix}#meta"]["kind"])
    if kind == "none":
        return None
    tensors = record_state(rd[prefix])
    if kind == "server_prototypes":
        return ServerPrototypes.from_state(tensors)
    if kind == "client_prototypes":
        counts = rd[f"{prefix}#counts"]
        return ClientPrototypes({int(c): t for c, t in tensors.items()}, {int(c): int(n) for c, n in counts.items()})
    if kind == "style_stats":
        return StyleStats(*(tensors[f] for f in STYLE_FIELDS))
    if kind == "tensor":
        return tensors["value"]
    if kind == "state":
        return tensors
    raise ValueError(f"{prefix}: unknown record kind {kind!r}")


def put_payload(rd: RecordDict, payload: dict[str, Any]) -> None:
    """``configure_train``'s payload of one participant (e.g. prototypes, a style pool)."""
    rd["payload#keys"] = ConfigRecord({"keys": sorted(payload)})
    for key in sorted(payload):
        put_value(rd, f"payload:{key}", payload[key])


def get_payload(rd: RecordDict) -> dict[str, Any]:
    return {key: get_value(rd, f"payload:{key}") for key in rd["payload#keys"]["keys"]}


def put_members(rd: RecordDict, members: dict[str, dict[str, torch.Tensor]]) -> None:
    rd["members#keys"] = ConfigRecord({"keys": sorted(members)})
    for name in sorted(members):
        rd[f"member:{name}"] = state_record(members[name])


def get_members(rd: RecordDict) -> dict[str, dict[str, torch.Tensor]]:
    return {name: record_state(rd[f"member:{name}"]) for name in rd["members#keys"]["keys"]}


def payload_bytes(rd: RecordDict) -> int:
    """Bytes of the tensors in a RecordDict (for the per-round traffic in the history)."""
    return sum(int(arr.numpy().nbytes) for rec in rd.array_records.values() for arr in rec.values())
