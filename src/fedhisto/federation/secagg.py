"""One masked sum on the ServerApp: Flower's own ``SecAggPlusWorkflow`` (flwr 1.42), driven stage by stage.

The workflow is written for Flower's legacy strategy API: it asks a ``Strategy`` for one ``FitIns``
per node (``configure_fit``) and hands the unmasked result to ``aggregate_fit``, on a
``LegacyContext``. Here the "strategy" is :class:`_Instructions`: each site's FitIns carries only the
round, the name of the kept terms and the weight the server assigned (``secure_site.contribution``
reads them at the site); ``aggregate_fit`` takes the sum and the nodes that made it. The parameters
the workflow averages are the site's weighted terms with ``num_examples = 1`` and ``max_weight = 1``,
so Flower's weighted average is the plain mean over the survivors, which times their number is the sum.

Stages are Flower's (``setup_stage``, ``share_keys_stage``, ``collect_masked_vectors_stage``,
``unmask_stage``, called in that order as ``SecAggPlusWorkflow.__call__`` calls them). One thing is
ours: a site lost at ``setup`` or ``share_keys`` (before its key shares reach the others) restarts the
protocol without it. Flower 1.42 would go on and, at ``unmask``, ask the others for shares of that
site's key that they never received (``secaggplus_mod._unmask`` indexes ``sk1_share_dict`` by the dead
node), which fails every survivor. A site lost at ``collect_masked_vectors`` is what SecAgg+ is built
for: its pairwise masks are rebuilt from the survivors' shares and the sum is the survivors'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

MODULUS = 2 ** 32


class PollingGrid:
    """The ``send_and_receive`` the workflow calls, pushing once and pulling every ``poll`` seconds (Flower
    1.42's ``Grid.send_and_receive`` sleeps 3 s between pulls), counting the bytes of every message."""

    def __init__(self, grid: Any, poll: float | None) -> None:
        self.grid = grid
        self.poll = poll if poll and hasattr(grid, "push_messages") and hasattr(grid, "pull_messages") else None
        self.down_bytes = self.up_bytes = 0

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        self.down_bytes += sum(_size(m.content) for m in messages)
        if self.poll is None:
            out = list(self.grid.send_and_receive(messages, timeout=timeout))
        else:
            ids = set(self.grid.push_messages(messages))
            end, out = time.time() + (timeout if timeout is not None else 1e9), []
            while ids and time.time() < end:
                got = list(self.grid.pull_messages(ids))
                out += got
                ids -= {m.metadata.reply_to_message_id for m in got}
                if ids:
                    time.sleep(self.poll)
        self.up_bytes += sum(_size(m.content) for m in out if not m.has_error())
        return out


def _size(rd: RecordDict) -> int:
    """Bytes of a message's arrays and bytes values (the masked vectors travel as bytes in a ConfigRecord)."""
    total = sum(len(a.data) for rec in rd.array_records.values() for a in rec.values())
    for rec in rd.config_records.values():
        for v in rec.values():
            items = v if isinstance(v, list) else [v]
            total += sum(len(x) for x in items if isinstance(x, bytes))
    return total


@dataclass
class _Instructions:
    """The legacy ``Strategy`` the workflow needs: fixed instructions out, the unmasked mean in."""

    fitins: dict[int, Any]
    mean: list[np.ndarray] | None = None
    survivors: list[int] = field(default_factory=list)

    def configure_fit(self, server_round, parameters, client_manager):
        return [(SimpleNamespace(node_id=nid), ins) for nid, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        from flwr.common import parameters_to_ndarrays

        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
            self.survivors = [proxy.node_id for proxy, _ in results]
        return None, {}


@dataclass
class MaskedSum:
    sum: list[np.ndarray] | None
    survivors: list[str]
    lost: dict[str, str]
    stages: list[dict]


def masked_sum(grid: Any, nodes: dict[str, int], weights: dict[str, float], round_idx: int, key: str,
               settings: Any, timeout: float, poll: float | None = 0.2, on_stage=None) -> MaskedSum:
    """``sum_k weights[k] * kept_k[key]`` over the sites that complete Flower's SecAgg+ (``settings``: the
    ``secure_aggregation`` config block). None as the sum when fewer than the threshold remain.
    ``on_stage(name, sites)`` is called before each stage (the run's events)."""
    from flwr.common import FitIns, Parameters
    from flwr.compat.common import recorddict_compat  # noqa: F401 (the workflow's own codec, imported with it)
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    site_of = {nodes[s]: s for s in weights}
    active, lost, stages = sorted(weights), {}, []
    polling = PollingGrid(grid, poll)
    while len(active) >= 2:
        wf = SecAggPlusWorkflow(float(settings.num_shares), float(settings.reconstruction_threshold), max_weight=1.0,
                                clipping_range=float(settings.clipping_range),
                                quantization_range=int(settings.quantization_levels), modulus_range=MODULUS,
                                timeout=timeout)
        plan = _Instructions({nodes[s]: FitIns(Parameters([], "numpy.ndarray"), {
            "fedhisto-site": s, "fedhisto-round": round_idx, "fedhisto-key": key,
            "fedhisto-weight": float(weights[s]), "fedhisto-clip": float(settings.clipping_range)}) for s in active})
        ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            strategy=plan)
        ctx.state.config_records["config"] = ConfigRecord({"current_round": round_idx + 1})
        ctx.state.array_records["parameters"] = ArrayRecord()
        state = WorkflowState()
        restart = False
        for stage in (wf.setup_stage, wf.share_keys_stage, wf.collect_masked_vectors_stage, wf.unmask_stage):
            if on_stage is not None:
                on_stage(stage.__name__.removesuffix("_stage"), active)
            t0 = time.perf_counter()
            ok = stage(polling, ctx, state)
            answered = sorted(site_of[n] for n in state.active_node_ids)
            stages.append({"stage": stage.__name__.removesuffix("_stage"), "s": round(time.perf_counter() - t0, 3),
                           "sites": answered})
            gone = [s for s in active if s not in answered]
            if stage.__name__ in ("setup_stage", "share_keys_stage") and gone:
                lost.update({s: f"lost in SecAgg+ {stage.__name__.removesuffix('_stage')}" for s in gone})
                active, restart = answered, True  # its key shares are not out yet: start again without it
                break
            if not ok:
                lost.update({s: f"SecAgg+ {stage.__name__.removesuffix('_stage')}: below the threshold" for s in active
                             if s not in lost})
                return MaskedSum(None, [], lost, _with_bytes(stages, polling))
        if restart:
            continue
        survivors = sorted(site_of[n] for n in plan.survivors)
        lost.update({s: "lost in SecAgg+ collect_masked_vectors (its masks rebuilt from the others' shares)"
                     for s in active if s not in survivors})
        total = ([np.asarray(np.asarray(m, dtype=np.float64) * len(survivors)) for m in plan.mean]
                 if plan.mean is not None else None)
        return MaskedSum(total, survivors if total is not None else [], lost, _with_bytes(stages, polling))
    lost.update({s: "fewer than two sites left for a masked sum" for s in active})
    return MaskedSum(None, [], lost, _with_bytes(stages, polling))


def _with_bytes(stages: list[dict], polling: PollingGrid) -> list[dict]:
    return [*stages, {"down_bytes": polling.down_bytes, "up_bytes": polling.up_bytes}]
