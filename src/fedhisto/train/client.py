"""One client's local work in a round, as plain tensors and functions (batchable later)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedhisto.config import Config
from fedhisto.federated.fedstain import StyleStats
from fedhisto.federated.losses import (
    class_balanced_weights,
    feature_consistency,
    js_divergence,
    prototype_v1,
    prototype_v2,
    proximal,
)
from fedhisto.federated.prototypes import ClientPrototypes, ServerPrototypes, client_prototypes
from fedhisto.methods import MethodSpec
from fedhisto.model.peft_model import N_CLASSES, FedHistoModel
from fedhisto.train.data import Split, eval_batches
from fedhisto.train.fedstain_client import feature_style, fedstain_terms
from fedhisto.views import training_views


@dataclass
class LocalResult:
    state: dict[str, torch.Tensor]
    n_samples: int
    losses: dict[str, float]


def stream_rng(seed: int, *stream: int) -> np.random.Generator:
    """The generator of one named random stream of a run (stream ids: 10 torch seed, 11 order, 12 FedStain
    statistics sample, 13 FedStain views)."""
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def local_train(model: FedHistoModel, global_state: dict[str, torch.Tensor], data: Split, descriptor: torch.Tensor | None,
                server_protos: ServerPrototypes | None, spec: MethodSpec, cfg: Config, seed: int, round_idx: int,
                client_idx: int, device: torch.device, style_pool: StyleStats | None = None) -> LocalResult:
    """2 local epochs from the global state; every random draw derives from (seed, round, client)."""
    if spec.style_exchange:
        if style_pool is None:
            raise ValueError("FedStain needs the pooled style statistics of the other clients")
        with feature_style(model, cfg.train.fedstain.mixstyle_after_layer) as hook:
            return _local_epochs(model, global_state, data, descriptor, server_protos, spec, cfg, seed, round_idx,
                                 client_idx, device, lambda x, y, w, rng: fedstain_terms(
                                     model, hook, x, y, style_pool, w, cfg, rng, device))
    return _local_epochs(model, global_state, data, descriptor, server_protos, spec, cfg, seed, round_idx,
                         client_idx, device, None)


def _local_epochs(model: FedHistoModel, global_state: dict[str, torch.Tensor], data: Split,
                  descriptor: torch.Tensor | None, server_protos: ServerPrototypes | None, spec: MethodSpec,
                  cfg: Config, seed: int, round_idx: int, client_idx: int, device: torch.device,
                  style_terms) -> LocalResult:
    t = cfg.train
    torch.manual_seed(int(stream_rng(seed, 10, round_idx, client_idx).integers(2**62)))
    model.load_trainable_state(global_state)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=t.lr, weight_decay=t.weight_decay)
    ce_weights = class_balanced_weights(data.class_counts(), t.cb_beta, t.cb_cap).to(device)
    global_dev = {k: v.to(device) for k, v in global_state.items()}
    micro = t.paired_micro_batch if spec.paired_views else t.single_view_batch
    accum = t.accumulation_steps if spec.paired_views else 1
    desc = descriptor.to(device)[None] if descriptor is not None else None
    sums: dict[str, float] = {}
    steps = 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    for epoch in range(t.local_epochs):
        order = stream_rng(seed, 11, round_idx, client_idx, epoch).permutation(len(data))
        view_epoch = round_idx * t.local_epochs + epoch
        opt.zero_grad(set_to_none=True)
        batches = [order[i:i + micro] for i in range(0, len(order), micro)]
        for b, idx in enumerate(batches):
            y = torch.tensor([data.labels[i] for i in idx], device=device)
            if style_terms is not None:  # FedStain: its own views and objective on the plain geometric view
                x = torch.stack([training_views(data.images[i], cfg.views, seed, view_epoch, data.ids[i], False,
                                                stain_single=False)[0] for i in idx])
                with autocast:
                    terms = style_terms(x, y, ce_weights, stream_rng(seed, 13, round_idx, client_idx, epoch, b))
            else:
                views = [training_views(data.images[i], cfg.views, seed, view_epoch, data.ids[i], spec.paired_views)
                         for i in idx]
                with autocast:
                    outs = [model(torch.stack([v[k] for v in views]).to(device), desc) for k in range(len(views[0]))]
                logits = [o[0].float() for o in outs]
                zs = [o[1].float() for o in outs]
                terms = {"ce": sum(torch.nn.functional.cross_entropy(lg, y, weight=ce_weights)
                                   for lg in logits) / len(logits)}
            if spec.paired_views and spec.use_js:
                terms["js"] = t.weight_js * js_divergence(logits[0], logits[1])
            if spec.paired_views and spec.use_feat:
                terms["feat"] = t.weight_feat * feature_consistency(zs[0], zs[1])
            if server_protos is not None and spec.prototypes != "none" and server_protos.mask.any():
                c, m, r = (server_protos.centroids.to(device), server_protos.mask.to(device),
                           server_protos.reliability.to(device))
                if spec.prototypes == "v2":
                    proto = sum(prototype_v2(z, y, c, m, r, t.proto_margin) for z in zs) / len(zs)
                else:
                    proto = sum(prototype_v1(z, y, c, m) for z in zs) / len(zs)
                terms["proto"] = t.weight_proto * proto
            if spec.proximal:
                terms["prox"] = proximal(params, global_dev, t.fedprox_mu)
            loss = sum(terms.values())
            (loss / accum).backward()
            if (b + 1) % accum == 0 or b + 1 == len(batches):
                torch.nn.utils.clip_grad_norm_(params.values(), t.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
            steps += 1
    return LocalResult(model.trainable_state(), len(data), {k: v / max(steps, 1) for k, v in sums.items()})


@torch.no_grad()
def embed_for_prototypes(model: FedHistoModel, data: Split, descriptor: torch.Tensor | None, cfg: Config,
                         device: torch.device) -> ClientPrototypes:
    """Centroids of at most ``proto_max_images`` optimisation images per present class (sample-id order)."""
    model.eval()
    keep, seen = [], [0] * N_CLASSES
    for i, y in enumerate(data.labels):
        if seen[y] < cfg.train.proto_max_images:
            keep.append(i)
            seen[y] += 1
    subset = Split([data.ids[i] for i in keep], [data.labels[i] for i in keep], [data.images[i] for i in keep])
    zs, ys = [], []
    desc = descriptor.to(device)[None] if descriptor is not None else None
    for x, y in eval_batches(subset, cfg.views, cfg.evaluate.eval_batch):
        zs.append(model.embed(x.to(device), desc).float().cpu())
        ys.append(y)
    return client_prototypes(torch.cat(zs), torch.cat(ys), N_CLASSES)


@torch.no_grad()
def predict(model: FedHistoModel, data: Split, descriptor: torch.Tensor | None, cfg: Config,
            device: torch.device) -> torch.Tensor:
    """Class probabilities (N x 3) with the deterministic evaluation transform."""
    model.eval()
    desc = descriptor.to(device)[None] if descriptor is not None else None
    probs = [torch.softmax(model(x.to(device), desc)[0].float(), dim=1).cpu()
             for x, _ in eval_batches(data, cfg.views, cfg.evaluate.eval_batch)]
    return torch.cat(probs) if probs else torch.zeros(0, N_CLASSES)
