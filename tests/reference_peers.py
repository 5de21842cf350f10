"""Calls into the code the reference tests compare fedhisto with (Flower's strategies) and the
reference-side helpers several of them share (a state's dense LoRA updates, numpy's truncated SVD).
Nothing here calls fedhisto: that is ``reference_support``'s job."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch
from reference_support import lora_keys


@contextmanager
def _flower_task() -> Iterator[None]:
    """Flower's Message needs a task identity (a ServerApp process has one); restored afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before


class _Grid:
    """The part of Flower's Grid a strategy's ``configure_train`` asks: the connected node ids."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def flower_round(strategy, server_round: int, current: Mapping[str, np.ndarray],
                 replies: list[tuple[Mapping[str, np.ndarray], float]]) -> tuple[dict[str, np.ndarray], dict]:
    """One round of a Flower (``flwr.serverapp.strategy``) strategy: ``configure_train`` with the
    current arrays to as many nodes as replies, each node answering with its arrays and its weight
    as ``num-examples``, then ``aggregate_train``. Returns (the aggregate arrays, the train config sent)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    def record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
        return ArrayRecord({k: Array(np.ascontiguousarray(v, dtype=np.float64)) for k, v in arrays.items()})

    with _flower_task():
        sent = list(strategy.configure_train(server_round, record(current), ConfigRecord(), _Grid(len(replies))))
        answers = [Message(RecordDict({"arrays": record(arrays), "metrics": MetricRecord({"num-examples": weight})}),
                           reply_to=msg) for msg, (arrays, weight) in zip(sent, replies, strict=True)]
        out, _ = strategy.aggregate_train(server_round, answers)
    return {k: v.numpy() for k, v in out.items()}, dict(sent[0].content["config"])


def dense(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, np.ndarray]:
    """A trainable state with every LoRA pair as its gauge-free update s B A (keyed by its A key with
    ``lora_A`` -> ``lora_BA``) and every other tensor as it is, as float64 arrays."""
    out = {}
    pairs = lora_keys(state)
    for a, b in pairs:
        out[a.replace("lora_A", "lora_BA")] = scaling * (state[b].double() @ state[a].double()).numpy()
    paired = {k for p in pairs for k in p}
    out.update({k: v.double().numpy() for k, v in state.items() if k not in paired and not k.startswith("folded_base.")})
    return out


def best_rank(matrix: np.ndarray, rank: int) -> np.ndarray:
    """The best rank-``rank`` approximation of ``matrix`` (numpy's SVD, truncated: Eckart-Young)."""
    u, s, vh = np.linalg.svd(matrix, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]
