"""The ServerApp's side of secure aggregation: ``train.secure_round`` over Flower messages and SecAgg+.

``SecureFlowerParticipants`` implements ``train.secure_round.SecureParticipants``: ``train`` and
``evaluate.post`` as without secure aggregation, except that a site keeps its terms (its reply
carries only its counts and their layout, ``secure_site``); a masked sum is Flower's SecAgg+
(``secagg.masked_sum``); ``query.statistics`` sends the masked sum of the updates and gets each
site's two scalars. ``FederatedRun._exchange`` logs what every reply held in the clear (its record
names, per site) to ``events.jsonl``, so a deployment can be audited for what the coordinator received.
"""

from __future__ import annotations

import json
import time

import torch
from flwr.app import RecordDict

from fedhisto.federation.records import state_record
from fedhisto.train.secure_round import Kept, run_secure_round


class SecureFlowerParticipants:
    """``train.secure_round.SecureParticipants`` over Flower (around ``server.FlowerParticipants``, whose
    messages it sends): the server holds no site's update."""

    round_driver = staticmethod(run_secure_round)

    def __init__(self, flower) -> None:
        self.flower, self.run, self.ex = flower, flower.run, flower.ex
        self.names = flower.names

    @property
    def traffic(self) -> dict:
        return self.flower.traffic

    def row_extra(self) -> dict:
        return self.flower.row_extra()

    def train_and_keep(self, r, starts, payloads):
        ok, lost = self.flower._train(r, starts, payloads)
        out = {}
        for n, rd in ok.items():
            if "state" in rd or "secure" not in rd:  # a site on a config without secure aggregation: refused
                lost[n] = "refused: its reply carries its state in the clear (not under secure aggregation)"
                continue
            out[n] = Kept(int(rd["metrics"]["num-examples"]), int(rd["metrics"]["steps"]),
                          [(name, tuple(shape)) for name, shape in json.loads(str(rd["secure"]["layout"]))])
        return out, lost

    def masked_sum(self, r, key, weights, shapes):
        from fedhisto.federation.secagg import masked_sum

        ex = self.ex
        missing = [s for s in weights if s not in ex.site_to_node]
        if missing:
            ex.discover()
        nodes = {s: ex.site_to_node[s] for s in weights if s in ex.site_to_node}
        lost = {s: "no SuperNode for this site is connected" for s in weights if s not in nodes}
        self.run._event(event="send", action=f"secagg:{key}", round=r + 1, sites=sorted(nodes))
        t0 = time.perf_counter()
        def on_stage(stage: str, sites: list[str]) -> None:
            self.run._event(event="secagg_stage", key=key, stage=stage, round=r + 1, sites=sites)

        got = masked_sum(ex.grid, nodes, {s: weights[s] for s in nodes}, r, key, self.run.cfg.secure_aggregation,
                         self.run.secure_timeout, getattr(ex, "poll", 0.2), on_stage)
        lost.update(got.lost)
        self.traffic[f"secagg:{key}"] = {"s": round(time.perf_counter() - t0, 3), "stages": got.stages}
        self.run._event(event="received", action=f"secagg:{key}", round=r + 1, ok=got.survivors, unavailable=lost)
        if got.sum is None:
            return {}, [], lost
        sums = {name: torch.from_numpy(arr).reshape(shape) for (name, shape), arr in zip(shapes, got.sum, strict=True)}
        return sums, got.survivors, lost

    def statistics(self, r, reference, names):
        contents = {}
        for n in names:
            rd = RecordDict({"run": self.run._run_record(n, r)})
            rd["reference"] = state_record({k: v.double() for k, v in reference.items()})
            contents[n] = rd
        ok, lost = self.run._exchange(self.ex, "query.statistics", contents, r, self.traffic)
        return {n: (float(rd["statistics"]["dot"]), float(rd["statistics"]["squared-norm"]))
                for n, rd in ok.items()}, lost

    def post_and_keep(self, r, members, uploaders):
        return self.flower.post(r, members, uploaders, upload_of=self._layout)

    @staticmethod
    def _layout(reply: RecordDict):
        if "upload" in reply or "secure" not in reply:
            raise RuntimeError("a site's post-aggregation reply carries its upload in the clear under secure aggregation")
        return [(name, tuple(shape)) for name, shape in json.loads(str(reply["secure"]["layout"]))]
