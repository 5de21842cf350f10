"""A message's whole content as one array: fewer objects on Flower's wire.

Flower 1.42 moves a message as a tree of objects (the message, its RecordDict, every record, every
array), each pulled or pushed by its own HTTP request at every hop (ServerApp -> SuperLink ->
SuperNode -> ClientApp and back). :func:`seal` serialises the RecordDict with Flower's own protobuf
codec into one uint8 array, so a message is four objects whatever it holds. Imports only flwr and
numpy: the per-message ClientApp process uses it without torch.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

ENVELOPE = "envelope"


def seal(rd: RecordDict) -> RecordDict:
    from flwr.common.serde import recorddict_to_proto

    blob = np.frombuffer(recorddict_to_proto(rd).SerializeToString(), dtype=np.uint8)
    return RecordDict({ENVELOPE: ArrayRecord({"b": Array(blob.copy())})})


def is_sealed(rd: RecordDict) -> bool:
    return set(rd.keys()) == {ENVELOPE}


def unseal(rd: RecordDict) -> RecordDict:
    """The RecordDict :func:`seal` packed; a RecordDict that is not sealed is returned as it is."""
    if not is_sealed(rd):
        return rd
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    return recorddict_from_proto(ProtoRecordDict.FromString(rd[ENVELOPE]["b"].numpy().tobytes()))


def annotate(reply: RecordDict, **info) -> RecordDict:
    """Add entries to a reply's ``info`` record, sealed or not."""
    sealed = is_sealed(reply)
    inner = unseal(reply)
    for k, v in info.items():
        inner["info"][k] = v
    return seal(inner) if sealed else inner
