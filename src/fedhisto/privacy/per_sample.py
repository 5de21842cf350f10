"""Per-unit gradients of the trainable state with ``torch.func`` (``functional_call`` + ``vmap(grad)``).

For a unit u with images I_u, each image i with its views x_i = (x_i1, ..., x_iV),

    g_u = sum_{i in I_u} grad_theta l(f_theta(x_i1..x_iV), y_i)

where ``l`` (a :data:`UnitLoss`) is the method's objective of ONE image: every view's terms and the
pair terms between its views together, so an image's two stain views are one sample and are clipped
together. ``vmap`` maps ``grad`` of that per-image loss over the images; a family's per-unit gradient
is the sum of its images' gradients (``index_add``). Exactly the tensors the method declares it trains
(:data:`Trained`: their names, and a 0/1 mask where a block is structurally zero) are differentiated;
everything else (the frozen encoder, FFA-LoRA's frozen A) is a constant of the call and gets no
gradient. A masked block's per-image gradient is projected to 0, so a clipping norm is over the
declared entries alone.

Why ``torch.func`` and not Opacus: it differentiates the real forward (peft's injected LoRA layers,
the transformers attention, GELU, LayerNorm, FiLM) without per-layer hooks, needs no module
support list and no extra dependency, and its per-sample gradients are, by construction, ``grad`` of
each sample's own loss; Opacus's hook-based grad samplers have an open silent-corruption report with
recent peft (meta-pytorch/opacus#820). ``tests/test_privacy_per_sample.py`` compares these gradients
with a loop of single-image backward passes in float64.

Dropout (``privacy.dropout``): ``per_sample`` keeps the method's dropout with masks drawn
independently for every image and view (``vmap(randomness="different")``), as non-private training
draws them per row; ``off`` switches every dropout module to eval for the per-sample pass and runs
``vmap(randomness="error")``, so any other random operation fails loudly. Either way each image's
gradient depends on that image alone, which is all clipping needs.

Attention: ``vmap`` has no batching rule for the fused CPU/flash SDPA kernels (it falls back to a
slow per-sample loop with a warning); :func:`per_sample_attention` runs the per-sample pass with
transformers' eager attention, the same function written with batched matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

#: The objective of one image from its views' outputs: (logits (V, C), embeddings (V, D), label ()) -> scalar.
UnitLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Dropout = Literal["per_sample", "off"]
#: What a method declares it trains, in the model's parameter order: name -> a 0/1 mask of the tensor's
#: shape (1 where an entry trains, 0 on a structurally zero block), or None where every entry trains.
Trained = Mapping[str, torch.Tensor | None]


def declared_parameters(model: nn.Module, trained: Trained) -> dict[str, torch.Tensor]:
    """The declared tensors of ``model``, detached, in the declaration's order (an unknown name is refused)."""
    own = dict(model.named_parameters())
    unknown = [n for n in trained if n not in own]
    if unknown:
        raise ValueError(f"declared trained tensors that the model does not have: {unknown[:3]}")
    return {n: own[n].detach() for n in trained}


def masked(grads: Mapping[str, torch.Tensor], trained: Trained, per_row: bool = False) -> dict[str, torch.Tensor]:
    """Each gradient projected onto its declared entries (``per_row``: dim 0 indexes images or units)."""
    out = {}
    for name, g in grads.items():
        mask = trained[name]
        if mask is not None:
            mask = mask.to(g.device, g.dtype)
            g = g * (mask[None] if per_row else mask)
        out[name] = g
    return out


@contextmanager
def dropout_disabled(model: nn.Module) -> Iterator[None]:
    """Every dropout module in eval mode for the block (restored after), the rest untouched."""
    drops = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for m in drops:
        m.eval()
    try:
        yield
    finally:
        for m in drops:
            m.train()


@contextmanager
def per_sample_attention(model: nn.Module) -> Iterator[None]:
    """Eager attention in every transformers config of the model for the block (SDPA has no vmap rule)."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    before = {k: c._attn_implementation for k, c in configs.items()}
    for c in configs.values():
        c._attn_implementation = "eager"
    try:
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = before[k]


def _no_batch_norm(model: nn.Module) -> None:
    bad = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if bad:
        raise ValueError(f"batch normalisation couples the samples of a batch, so per-sample gradients are not "
                         f"defined: {bad[:3]}")


def per_image_gradients(model: nn.Module, unit_loss: UnitLoss, views: torch.Tensor, labels: torch.Tensor,
                        descriptor: torch.Tensor | None = None, *, trained: Trained, dropout: Dropout = "per_sample",
                        chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """grad_theta l_i for every image i over the ``trained`` tensors: ``views`` (B, V, 3, H, W), ``labels`` (B,);
    returns {name: (B, *shape)}, each projected onto its declared entries.

    ``model`` is called as ``model(pixels (V, 3, H, W), descriptor) -> (logits, z)`` (``FedHistoModel``);
    ``chunk_size`` bounds how many images ``vmap`` differentiates at once (memory), not the result."""
    if views.dim() != 5:
        raise ValueError(f"views must be (images, views, 3, H, W), got shape {tuple(views.shape)}")
    if labels.shape != views.shape[:1]:
        raise ValueError(f"{labels.shape[0] if labels.dim() else 'scalar'} labels for {views.shape[0]} images")
    if dropout not in ("per_sample", "off"):
        raise ValueError(f"privacy.dropout must be 'per_sample' or 'off', got {dropout!r}")
    _no_batch_norm(model)
    params = declared_parameters(model, trained)

    def image_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, z = functional_call(model, p, (x, descriptor))
        return unit_loss(_at_least_float32(logits), _at_least_float32(z), y)

    randomness = "different" if dropout == "per_sample" else "error"
    per_image = vmap(grad(image_loss), in_dims=(None, 0, 0), randomness=randomness, chunk_size=chunk_size)
    with per_sample_attention(model), (dropout_disabled(model) if dropout == "off" else _nothing()):
        return masked(per_image(params, views, labels), trained, per_row=True)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Autocast's bfloat16 outputs go to float32 (as the engines' losses take them); float64 stays."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def sum_by_unit(per_image: dict[str, torch.Tensor], unit_index: torch.Tensor, n_units: int) -> dict[str, torch.Tensor]:
    """g_u = sum of the per-image gradients of unit u: ``unit_index`` (B,) in 0..n_units-1 -> {name: (n_units, ...)}."""
    if unit_index.dim() != 1 or (unit_index.numel() and (unit_index.min() < 0 or unit_index.max() >= n_units)):
        raise ValueError(f"unit indices must be a vector in 0..{n_units - 1}")
    out = {}
    for name, g in per_image.items():
        if g.shape[0] != unit_index.numel():
            raise ValueError(f"{name}: {g.shape[0]} per-image gradients for {unit_index.numel()} unit indices")
        out[name] = torch.zeros((n_units, *g.shape[1:]), dtype=g.dtype, device=g.device).index_add_(
            0, unit_index.to(g.device), g)
    return out


def per_unit_gradients(model: nn.Module, unit_loss: UnitLoss, views: torch.Tensor, labels: torch.Tensor,
                       unit_index: torch.Tensor, n_units: int, descriptor: torch.Tensor | None = None, *,
                       trained: Trained, dropout: Dropout = "per_sample",
                       chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """Per-unit gradients of a micro-batch of whole units (``dpsgd.pack_micro_batches``): per-image
    gradients summed over each unit's images. With ``privacy.unit: image`` pass ``arange(B)``."""
    per_image = per_image_gradients(model, unit_loss, views, labels, descriptor, trained=trained, dropout=dropout,
                                    chunk_size=chunk_size)
    return sum_by_unit(per_image, unit_index, n_units)
