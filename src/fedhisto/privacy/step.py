"""One logical DP-SGD step from the pieces, for an engine to call once per Poisson batch.

    selected = dpsgd.poisson_sample(units.n_units, q, rng)                        # the logical batch
    grads = logical_step(model, loss, units, selected, fetch, acc, gen, trained=t)  # clip, sum, noise, / (q N)
    set_gradients(model, grads, t); optimizer.step()                              # then a data-free term's grad

``trained`` (``per_sample.Trained``) is the method's declaration of what it trains: the only tensors that
are differentiated, clipped, noised and given a gradient.

``fetch(image_indices)`` returns the views (images, V, 3, H, W) and labels of those images of the
site, drawn as the engine draws training views; it is the only place the engine's data handling
enters. The accountant counts one step per call, whether or not any unit was sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedhisto.privacy.dpsgd import NoisyGradientSum, PrivacyUnits, pack_micro_batches
from fedhisto.privacy.per_sample import (
    Dropout,
    Trained,
    UnitLoss,
    declared_parameters,
    masked,
    per_unit_gradients,
)

Fetch = Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]


def logical_step(model: nn.Module, unit_loss: UnitLoss, units: PrivacyUnits, selected: np.ndarray, fetch: Fetch,
                 accumulator: NoisyGradientSum, generator: torch.Generator, *, trained: Trained, micro_batch: int,
                 descriptor: torch.Tensor | None = None, dropout: Dropout = "per_sample",
                 chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """The noisy mean gradient of one Poisson batch of units over the ``trained`` tensors, by micro-batches of
    whole units."""
    sizes = units.sizes()
    for pack in pack_micro_batches(selected, sizes, micro_batch):
        images = np.concatenate([units.images_of(u) for u in pack])
        local = torch.as_tensor(np.repeat(np.arange(len(pack)), [sizes[u] for u in pack]))
        views, labels = fetch(images)
        if views.shape[0] != len(images) or labels.shape[0] != len(images):
            raise ValueError(f"fetch returned {views.shape[0]} views and {labels.shape[0]} labels for {len(images)} images")
        accumulator.add(per_unit_gradients(model, unit_loss, views, labels, local, len(pack), descriptor,
                                           trained=trained, dropout=dropout, chunk_size=chunk_size))
    return accumulator.release(declared_parameters(model, trained), generator, trained)


def set_gradients(model: nn.Module, grads: dict[str, torch.Tensor], trained: Trained) -> None:
    """Install a released gradient (plus any data-free term's) as ``.grad`` of exactly the declared tensors,
    projected onto their masks; every declared tensor must be present and nothing else."""
    if set(trained) != set(grads):
        raise ValueError(f"gradient does not fit the declared trained tensors: missing "
                         f"{sorted(set(trained) - set(grads))[:3]}, unexpected {sorted(set(grads) - set(trained))[:3]}")
    own = dict(model.named_parameters())
    for n, g in masked(grads, trained).items():
        own[n].grad = g.to(own[n].dtype).clone()
