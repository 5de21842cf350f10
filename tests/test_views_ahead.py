"""Host views made ahead by background threads (``train.view_workers``): the engine's own views, bitwise, and a
batched round with view workers is bitwise the round without them."""

from __future__ import annotations

import os

import pytest
import torch
from test_batched import round_inputs

from fedhisto.methods import method_names
from fedhisto.train.batched import batched_local_train
from fedhisto.train.plan import batch_of, epoch_batches, local_run
from fedhisto.train.view_workers import StepsAhead, made_ahead, step_views, view_workers


def test_the_setting_resolves_to_threads_on_cuda_with_host_views_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert view_workers(None, cpu, "batched", "host") == 0  # a CPU: the views would share the step's cores
    assert view_workers(None, cuda, "batched", "host") == max(1, len(os.sched_getaffinity(0)) - 1)
    assert view_workers(None, cuda, "batched", "device") == 0 and view_workers(None, cuda, "sequential", "host") == 0
    assert view_workers(3, cpu, "batched", "host") == 3 and view_workers(0, cuda, "batched", "host") == 0


@pytest.mark.parametrize("name", [n for n in method_names() if n.startswith(("past_v2", "fedavg", "fedstain"))])
def test_views_made_ahead_are_the_methods_own_views(name):
    """For every method whose views are the default host path, each member's views of a step made by the
    workers equal ``method.batch_inputs`` (the engine's path without workers) bitwise; a method with views of
    its own is never made ahead."""
    from concurrent.futures import ThreadPoolExecutor

    cfg, strategy, model, device, jobs = round_inputs(name)
    method = strategy.objective  # the client half: whose views the engine makes
    if not made_ahead(method, cfg):
        from fedhisto.methods.objective import Objective

        assert type(method).batch_inputs is not Objective.batch_inputs  # FedStain's AugMix views, its code's
        with ThreadPoolExecutor(2) as pool:
            assert step_views(method, cfg, jobs, [], [], None, 0, pool, False, 0) is None
        return
    plan = method.local_schedule(jobs[0].round_idx)
    runs = [local_run(model, j, cfg, plan, device, {}) for j in jobs]
    batches = [epoch_batches(j, 1, plan.micro_batch) for j in jobs]
    with ThreadPoolExecutor(2) as pool:
        for b in range(max(len(x) for x in batches)):
            made = step_views(method, cfg, jobs, runs, batches, plan, 1, pool, False, b)
            assert sorted(made) == [m for m in range(len(jobs)) if b < len(batches[m])]
            for m, views in made.items():
                own = method.batch_inputs(runs[m], batch_of(jobs[m], plan, 1, b, batches[m][b], device)).views
                assert len(views) == len(own) and all(torch.equal(a, o) for a, o in zip(views, own, strict=True))


@pytest.mark.parametrize("name", ["past_v2", "fedavg_peft"])
def test_a_round_with_view_workers_is_bitwise_the_round_without(name):
    ends = {}
    for workers in (0, 2):
        cfg, method, model, device, jobs = round_inputs(name, {"view_workers": workers, "engine": "batched"})
        ends[workers] = batched_local_train(method.objective, model, jobs, cfg, device)
    for a, b in zip(ends[0], ends[2], strict=True):
        assert a.state.keys() == b.state.keys() and all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        assert a.losses == b.losses and a.steps == b.steps


def test_steps_ahead_makes_each_step_once_in_order_of_need():
    made = []
    ahead = StepsAhead(lambda b: made.append(b) or b * 10, steps=5, workers=1)
    try:
        assert [ahead.get(b) for b in range(5)] == [0, 10, 20, 30, 40]
    finally:
        ahead.close()
    assert sorted(made) == [0, 1, 2, 3, 4]
    serial = StepsAhead(lambda b: b + 1, steps=3, workers=0)
    assert [serial.get(b) for b in range(3)] == [1, 2, 3] and serial.orchestrator is None


def test_view_workers_asked_for_where_they_cannot_act_are_refused():
    from fedhisto.config.study import load_config
    from fedhisto.infra.settings_base import ConfigError

    for train in ({"engine": "sequential"}, {"engine": "batched", "view_pipeline": "device"}):
        with pytest.raises((ConfigError, ValueError), match=r"train\.view_workers: 2 makes the batched engine's host"):
            load_config({"train": {**train, "view_workers": 2}})
        load_config({"train": {**train, "view_workers": 0}})  # off, or auto: fine anywhere
        load_config({"train": train})
