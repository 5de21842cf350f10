"""Host views made ahead, by background threads, while the device runs the step (``train.view_workers``).

The host path (``data.views.training_views``) makes about 80 paired views a second on one core; a GPU step
of the batched engine consumes them far faster, so made in the engine's own thread, one after the other,
they bound a GPU round by the host. Here the views of the next steps are made while the current one runs:
a small lookahead of steps (``LOOKAHEAD``), each step's images spread over ``workers`` threads (OpenCV and
NumPy's array work runs outside the GIL), stacked per view and, on CUDA, put in pinned memory so the copy
to the device does not wait for the host.

The views are the engine's own: ``Objective.batch_inputs``'s host path, ``training_views`` with the view
generator of (seed, epoch, sample id), so the order in which threads make them changes no pixel and a
round with workers is bitwise the round without (tests/test_views_ahead.py). Only methods whose views are
that default path are made ahead (``made_ahead``); a method whose objective makes views of its own (an
augmentation chain of its paper) and the device view pipeline keep their path.

``train.view_workers``: null (auto) gives a CUDA run of the batched engine with host views one thread per
CPU this process may use, less one for the engine; a CPU run none (the views would compete with the step
for the same cores); 0 turns it off; n > 0 asks for n threads anywhere. Where and how fast, not what: not
part of a run's identity.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fedhisto.data.views import training_views

#: steps made ahead of the one the engine runs
LOOKAHEAD = 2


def view_workers(setting: int | None, device: torch.device, engine: str, view_pipeline: str) -> int:
    """Threads that make host views ahead for a run (module docstring)."""
    if setting is not None:
        return setting
    if device.type != "cuda" or engine != "batched" or view_pipeline != "host":
        return 0
    return max(1, len(os.sched_getaffinity(0)) - 1)


def made_ahead(method: Any, cfg: Any) -> bool:
    """Whether ``method``'s views are the default host path (and so may be made ahead)."""
    from fedhisto.methods.objective import Objective

    return cfg.train.view_pipeline == "host" and type(method).batch_inputs is Objective.batch_inputs


def host_views(run: Any, idx: Sequence[int], view_epoch: int, paired: bool, stain_single: bool | None,
               pool: ThreadPoolExecutor | None, pin: bool) -> list[torch.Tensor]:
    """``Objective.batch_inputs``'s host views of images ``idx``: one (b, 3, S, S) tensor per view."""
    def one(i: int) -> list[torch.Tensor]:
        return training_views(run.data.images[i], run.cfg.views, run.seed, view_epoch, run.data.ids[i], paired,
                              stain_single)

    views = list(pool.map(one, idx)) if pool is not None else [one(i) for i in idx]
    stacked = [torch.stack([v[k] for v in views]) for k in range(len(views[0]))]
    return [t.pin_memory() for t in stacked] if pin else stacked


class StepsAhead:
    """``make(step)`` for the next ``LOOKAHEAD`` steps in background, as the engine asks for each in order.

    ``make`` must be a pure function of its step (the views' random draws are keyed by image, epoch and
    seed). ``get(step)`` returns its result (made ahead, or now) and schedules the following steps."""

    def __init__(self, make: Callable[[int], Any], steps: int, workers: int) -> None:
        self.make, self.steps = make, steps
        self.orchestrator = ThreadPoolExecutor(1, thread_name_prefix="views-ahead") if workers > 0 else None
        self.pending: dict[int, Future] = {}

    def get(self, step: int) -> Any:
        if self.orchestrator is None:
            return self.make(step)
        for ahead in range(step, min(step + LOOKAHEAD + 1, self.steps)):
            if ahead not in self.pending:
                self.pending[ahead] = self.orchestrator.submit(self.make, ahead)
        return self.pending.pop(step).result()

    def close(self) -> None:
        if self.orchestrator is not None:
            for future in self.pending.values():
                future.cancel()
            self.orchestrator.shutdown(wait=True)
            self.pending.clear()


def step_views(method: Any, cfg: Any, jobs: Sequence[Any], runs: list, batches: list, plan: Any, epoch: int,
               pool: ThreadPoolExecutor | None, pin: bool, b: int) -> dict[int, list[torch.Tensor]] | None:
    """The batched engine's step ``b``: the host views of every member active in it, or None where the
    method's views are not the default host path (the engine then asks the method, in order)."""
    from fedhisto.train.plan import view_epoch

    if pool is None or not made_ahead(method, cfg):
        return None
    return {m: host_views(runs[m], batches[m][b], view_epoch(jobs[m], plan, epoch), method.paired_views,
                          method.stain_single, pool, pin)
            for m in range(len(jobs)) if b < len(batches[m])}
