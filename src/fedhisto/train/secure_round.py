"""One round under secure aggregation: the server step sees weighted sums, never a site's update.

The round of ``train.loop.run_round`` with the method's secure-aggregation hooks
(``methods.secure_capability``, each method's own declaration):

1. the server sends every participant its start state and payload; each trains and **keeps** what it
   will mask (``Objective.secure_terms``; with statistics weights also its update ``secure_statistic``),
   answering only public facts: its sample count, step count and the layout of its terms;
2. the weights: sample mass from the stated counts, uniform, or (``weights: statistics``) a masked sum S
   of the updates, then each site's ||D_k||^2 and D_k . S in the clear (``Strategy.secure_weights``);
3. a masked sum of ``a_k t_k`` over the sites; the server divides by the survivors' weights, which it
   assigned, and runs ``Strategy.aggregate_sums``;
4. (``post_uploads``) with the new global model each site keeps its upload's terms
   (``Objective.secure_post_terms``); one more masked sum, ``Strategy.aggregate_post_sums``.

*How* a masked sum is computed is the participants' (``SecureParticipants``): Flower's SecAgg+ over
stock processes (``federation.secure_server``), or here in process, :class:`SecureInProcess`, the same
quantised sum without masks (they cancel exactly), with rounding draws from the run's stream so that
a resumed run replays a round exactly. A masked sum never covers fewer sites than the method's
``min_sites``; a round that cannot reach it stops the run (``TooManyUnavailable``) rather than reveal.

Dropouts: a site lost before a masked sum is out of it (and of the weights); one lost inside a masked
sum is recovered by SecAgg+ and left out. A site lost after the statistics sum keeps its part in S
(the weights of the others are computed against S as it was): summing the statistics again without it
would reveal its update as the difference of the two sums.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fedhisto.fedmath.secure_sums import (
    Quantiser,
    Terms,
    dense,
    field_sum,
    layout,
    mean_bound,
    weighted_arrays,
)
from fedhisto.methods.base import GLOBAL, stream_rng
from fedhisto.methods.secure_capability import SecureSums, SiteStatistics
from fedhisto.methods.strategy import Strategy
from fedhisto.model.peft_model import FedHistoModel
from fedhisto.train.loop import ClientFailure, State, TooManyUnavailable, model_device, run_round

log = logging.getLogger(__name__)
SECURE_ROUNDING_STREAM = 27  # the run's stream of stochastic-rounding draws (in process)
KEYS = ("statistic", "terms", "post")
LOSS = "loss:"  # the masked terms carrying a site's training losses (their weighted mean is recorded)
LOSS_SCALE = 64.0  # losses are masked divided by this, so that a loss up to 512 stays in the clipping range


def quantiser_of(cfg: Any) -> Quantiser:
    s = cfg.secure_aggregation
    return Quantiser(s.clipping_range, s.quantization_levels)


@dataclass(frozen=True)
class Kept:
    """What a participant answers in the clear after training under secure aggregation."""

    n_samples: int
    steps: int
    layout: list[tuple[str, tuple[int, ...]]]


class SecureParticipants(Protocol):
    """How the secure round reaches its participants (each call: what came back, and who was lost, why)."""

    names: list[str]

    def train_and_keep(self, r: int, starts: dict[str, State], payloads: dict[str, dict]
                       ) -> tuple[dict[str, Kept], dict[str, str]]: ...

    def masked_sum(self, r: int, key: str, weights: dict[str, float], shapes: list[tuple[str, tuple[int, ...]]]
                   ) -> tuple[dict[str, torch.Tensor], list[str], dict[str, str]]:
        """sum_k weights[k] * kept[key] over the sites that completed it (float64), the survivors, the lost."""

    def statistics(self, r: int, reference: dict[str, torch.Tensor], names: list[str]
                   ) -> tuple[dict[str, tuple[float, float]], dict[str, str]]:
        """Per site (D_k . S, ||D_k||^2) of its kept statistic against the masked sum ``reference``."""

    def post_and_keep(self, r: int, members: dict[str, State], uploaders: list[str]
                      ) -> tuple[dict[str, list], dict[str, str], dict[str, float]]:
        """Validation of every member, and each uploader's post terms kept (their layouts returned)."""

    def row_extra(self) -> dict: ...


def client_terms(method: Strategy, state: State, start: State, scaling: float, losses: dict[str, float]) -> Terms:
    """What a site masks in the contribution sum: its method's terms and its losses (a weighted mean is kept)."""
    terms = method.objective.secure_terms(state, start, scaling)
    terms.update({f"{LOSS}{k}": torch.tensor(float(v) / LOSS_SCALE, dtype=torch.float64) for k, v in losses.items()})
    return terms


def _enough(what: str, r: int, sites: list[str] | dict, least: int, lost: dict[str, str]) -> None:
    if len(sites) < least:
        raise TooManyUnavailable(f"round {r + 1}: {what} would cover {len(sites)} site(s) ({sorted(sites)}); secure "
                                 f"aggregation of this method needs at least {least} (lost: {lost})")


def run_secure_round(method: Strategy, parts: SecureParticipants, ckpt: dict, r: int, model: FedHistoModel
                     ) -> tuple[dict, dict]:
    """One round (see the module docstring); the history row records the weights the server assigned
    (over the survivors), the weighted mean losses and each masked sum's survivors and bound."""
    decl = method.secure_aggregation()
    if not decl.runs:
        raise ValueError(f"method {method.name!r} cannot run under secure aggregation: {decl.refusal}")
    if not decl.exchanges:  # a reference that aggregates nothing (each site alone, or one central site) runs as it does
        return run_round(method, parts.inner if hasattr(parts, "inner") else parts, ckpt, r, model)
    quantiser, least = quantiser_of(method.cfg), max(2, decl.min_sites)
    names, members = parts.names, ckpt["members"]
    starts = {n: method.start_state(members, n) for n in names}
    payloads = method.configure_train(r, ckpt["server_state"], dict.fromkeys(names))
    kept, unavailable = parts.train_and_keep(r, starts, payloads)
    _enough("the round's masked sums", r, kept, least, unavailable)
    returned = sorted(kept)
    expected = layout(method.objective.secure_terms(starts[returned[0]], starts[returned[0]], model.lora_scaling))
    shapes = kept[returned[0]].layout
    for n in returned:  # every site must mask the same arrays in the same order (Flower sums by position)
        if kept[n].layout != shapes or [x for x in shapes if not x[0].startswith(LOSS)] != expected:
            raise ClientFailure(n, r, ValueError(f"its masked terms {kept[n].layout} differ from the method's "
                                                 f"{expected} (or from the other sites')"))
    secure: dict[str, Any] = {}
    if decl.weights == "statistics":
        stat_shapes = layout(method.objective.secure_statistic(starts[returned[0]], starts[returned[0]], model.lora_scaling))
        total, summed, lost = parts.masked_sum(r, "statistic", dict.fromkeys(returned, 1.0), stat_shapes)
        unavailable.update({n: f"statistics sum: {why}" for n, why in lost.items()})
        _enough("the statistics sum", r, summed, least, unavailable)
        stated, lost = parts.statistics(r, total, summed)
        unavailable.update({n: f"statistics: {why}" for n, why in lost.items()})
        _enough("the weighted sum", r, stated, least, unavailable)
        s_sq = float(sum((t.double() ** 2).sum() for t in total.values()))
        weights = method.secure_weights(SiteStatistics({n: kept[n].n_samples for n in stated},
                                                       {n: stated[n][1] for n in stated},
                                                       {n: stated[n][0] for n in stated}, s_sq, len(summed)))
        secure["statistics"] = {"summed": summed, "stated": sorted(stated)}
    elif decl.weights == "uniform":
        weights = {n: 1.0 / len(returned) for n in returned}
    else:
        total_n = float(sum(kept[n].n_samples for n in returned))
        weights = {n: kept[n].n_samples / total_n for n in returned}
    sums, survivors, lost = parts.masked_sum(r, "terms", weights, shapes)
    unavailable.update({n: f"masked sum: {why}" for n, why in lost.items()})
    _enough("the weighted sum", r, survivors, least, unavailable)
    got = {n: weights[n] for n in survivors}
    bound = mean_bound(quantiser, len(survivors), sum(got.values()))
    secure["terms"] = {"sites": survivors, "bound": bound}
    losses = {k.removeprefix(LOSS): LOSS_SCALE * float(v) / sum(got.values()) for k, v in sums.items()
              if k.startswith(LOSS)}
    # the sums arrive on the host (the field arithmetic is NumPy's); the server step computes where the run
    # does, so its members and server state stay on the run's device, as without secure aggregation
    device = model_device(model)
    sums = {k: v.to(device) for k, v in sums.items() if not k.startswith(LOSS)}
    new_members, server_state = method.aggregate_sums(
        SecureSums(r, sums, got, starts[survivors[0]], ckpt["server_state"], bound), model)
    members = {**members, **new_members}
    uploaders = survivors if method.post_uploads else []
    post_kept, lost_post, member_metrics = parts.post_and_keep(r, members, uploaders)
    for n, why in lost_post.items():
        unavailable[n] = f"unavailable after aggregation: {why}"
    if method.post_uploads:
        server_state = None  # as in process when no upload came back; below least, a sum would reveal a site
        if len(post_kept) >= 2:
            post_shapes = next(iter(post_kept.values()))
            total, summed, lost = parts.masked_sum(r, "post", dict.fromkeys(sorted(post_kept), 1.0), post_shapes)
            unavailable.update({n: f"post-aggregation sum: {why}" for n, why in lost.items()})
            if len(summed) >= 2:
                server_state = method.aggregate_post_sums(
                    SecureSums(r, {k: v.to(device) for k, v in total.items()}, dict.fromkeys(summed, 1.0), members.get(GLOBAL, {}), server_state,
                               mean_bound(quantiser, len(summed), len(summed))), server_state)
                secure["post"] = {"sites": summed}
    ckpt.update(members=members, server_state=server_state)
    snapshot = getattr(parts, "state", None)
    kept_state = snapshot() if snapshot is not None else None
    if kept_state is not None:
        ckpt["participants"] = kept_state
    total_w = sum(got.values())
    row = {"weights": {n: w / total_w for n, w in got.items()}, "unavailable_clients": unavailable,
           "losses": {"weighted_mean": losses} if losses else {}, "secure_aggregation": secure,
           **parts.row_extra()}
    return row, member_metrics


@dataclass
class SecureInProcess:
    """In-process participants under secure aggregation: the sites' terms stay in their own entries and
    a masked sum is the quantised sum SecAgg+ reveals (``fedmath.secure_sums.field_sum``); the round's
    server code sees only its result. Wraps ``train.participants.InProcess`` (DP-SGD included)."""

    inner: Any
    seed: int
    kept: dict[str, dict[str, Terms]] = field(default_factory=lambda: {k: {} for k in KEYS})

    @staticmethod
    def round_driver(method, parts, ckpt, r, model):  # train.loop.run_rounds runs this round
        return run_secure_round(method, parts, ckpt, r, model)

    @property
    def names(self) -> list[str]:
        return self.inner.names

    @property
    def method(self) -> Strategy:
        return self.inner.method

    def state(self):
        return self.inner.state()

    def restore(self, saved) -> None:
        self.inner.restore(saved)

    def row_extra(self) -> dict:
        return self.inner.row_extra()

    def _site(self, n: str, r: int, fn):
        try:
            return fn()
        except Exception as exc:  # a site's own refusal (a value outside the clipping range): named
            raise ClientFailure(n, r, exc) from exc

    def train_and_keep(self, r, starts, payloads):
        results, lost = self.inner.train(r, starts, payloads)
        scaling, stats = self.inner.model.lora_scaling, self.method.secure_aggregation().weights == "statistics"
        self.kept = {k: {} for k in KEYS}
        out = {}
        for n, res in results.items():
            terms = client_terms(self.method, res.state, starts[n], scaling, res.losses)
            self.kept["terms"][n] = terms
            if stats:
                self.kept["statistic"][n] = self.method.objective.secure_statistic(res.state, starts[n], scaling)
            out[n] = Kept(res.n_samples, res.steps, layout(terms))
        return out, lost

    def masked_sum(self, r, key, weights, shapes):
        quantiser = quantiser_of(self.method.cfg)
        names = sorted(weights)
        arrays = [self._site(n, r, lambda n=n: weighted_arrays(self.kept[key][n], weights[n], quantiser, f"site {n}"))
                  for n in names]
        draws = []
        for n, arrs in zip(names, arrays, strict=True):
            rng = stream_rng(self.seed, SECURE_ROUNDING_STREAM, r, self.names.index(n), KEYS.index(key))
            draws.append([rng.random(a.shape) for a in arrs])
        total = field_sum(arrays, quantiser, draws)
        return {name: torch.from_numpy(t) for (name, _), t in zip(shapes, total, strict=True)}, names, {}

    def statistics(self, r, reference, names):
        out = {}
        for n in names:
            terms = self.kept["statistic"][n]
            vals = {k: dense(terms[k]) for k in terms}
            out[n] = (float(sum((vals[k] * reference[k]).sum() for k in vals)),
                      float(sum((vals[k] ** 2).sum() for k in vals)))
        return out, {}

    def post_and_keep(self, r, members, uploaders):
        after, lost, metrics = self.inner.post(r, members, uploaders)
        shapes = {}
        for n, upload in after.items():
            self.kept["post"][n] = self._site(n, r, lambda u=upload: self.method.objective.secure_post_terms(u))
            shapes[n] = layout(self.kept["post"][n])
        return shapes, lost, metrics
