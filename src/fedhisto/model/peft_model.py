"""The trainable pathway on a frozen encoder: LoRA (through peft), residual adapter, FiLM, classifier.

pixels -> frozen encoder with LoRA on attention query/key/value/output -> pooled embedding (CLS, or
CLS + mean patch token, as the encoder's registry entry says)
-> residual adapter -> FiLM(stain descriptor) -> adapted embedding z -> linear classifier.
z feeds the classifier, feature consistency and the prototypes. Both stain views share every module.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from fedhisto.config.study import ModelConfig
from fedhisto.model.encoder import FrozenEncoder, encoder_blocks, pooled_embedding

DESCRIPTOR_DIM = 14
N_CLASSES = 3

class ResidualAdapter(nn.Module):
    """x + W2 dropout(act(W1 LayerNorm(x))): 768 -> 256 -> 768 with the study's shape."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.down = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.up = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(self.drop(self.act(self.down(self.norm(x)))))


class FiLM(nn.Module):
    """Stain-conditioned feature modulation: z * (1 + s * gamma(d)) + s * beta(d), s = 0.10.

    The output layer starts at zero so FiLM begins as the identity and the descriptor's
    influence is learned, bounded by the fixed modulation scale.
    """

    def __init__(self, dim: int, hidden: int, scale: float, descriptor_dim: int = DESCRIPTOR_DIM,
                 bound: str = "unbounded") -> None:
        super().__init__()
        if bound not in ("unbounded", "tanh"):
            raise ValueError(f"FiLM bound {bound!r}: unbounded or tanh (model.film_bound)")
        self.scale, self.bound = scale, bound
        self.hidden = nn.Linear(descriptor_dim, hidden)
        self.act = nn.GELU()
        self.out = nn.Linear(hidden, 2 * dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, z: torch.Tensor, descriptor: torch.Tensor) -> torch.Tensor:
        gamma, beta = self.out(self.act(self.hidden(descriptor))).chunk(2, dim=-1)
        if self.bound == "tanh":  # model.film_bound: |modulation| <= scale, the study's "limiting the magnitude"
            gamma, beta = torch.tanh(gamma), torch.tanh(beta)
        return z * (1 + self.scale * gamma) + self.scale * beta


def lora_target_modules(encoder: FrozenEncoder, targets: list[str]) -> list[str]:
    """Full names of the encoder modules LoRA attaches to, as the encoder's registry entry names them."""
    return encoder.lora_module_names(targets)


class FedHistoModel(nn.Module):
    """``encoder`` (the backbone module, with LoRA injected) keeps its library's tensor names, so the
    trainable state's names are the library's; what the model does with it (pooling, blocks) is
    asked of the registry entry through ``encoder_embedding`` and ``encoder_blocks``."""

    def __init__(self, encoder: FrozenEncoder, cfg: ModelConfig, film: bool) -> None:
        super().__init__()
        for p in encoder.parameters():
            p.requires_grad_(False)
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=lora_target_modules(encoder, cfg.lora_targets), bias="none")
        self.encoder = inject_adapter_in_model(lora, encoder.module)
        self.encoder_entry = encoder.entry
        for name, p in self.encoder.named_parameters():
            p.requires_grad_("lora_" in name)
        dim = encoder.dim
        self.adapter = ResidualAdapter(dim, cfg.adapter_hidden, cfg.adapter_dropout)
        self.film = FiLM(dim, cfg.film_hidden, cfg.film_scale, bound=cfg.film_bound) if film else None
        self.classifier = nn.Linear(dim, N_CLASSES)
        self.lora_scaling = cfg.lora_alpha / cfg.lora_r

    def encoder_embedding(self, pixels: torch.Tensor) -> torch.Tensor:
        """The frozen encoder's (LoRA-adapted) embedding (B, dim), pooled as its registry entry says."""
        return pooled_embedding(self.encoder_entry, self.encoder, pixels)

    def encoder_blocks(self) -> list[nn.Module]:
        """The encoder's transformer blocks in order (FedStain's restyling hooks one of them)."""
        return encoder_blocks(self.encoder_entry, self.encoder)

    def adapt(self, cls: torch.Tensor, descriptor: torch.Tensor | None = None) -> torch.Tensor:
        """The adapted embedding z of encoder embeddings: residual adapter, then FiLM."""
        z = self.adapter(cls)
        if self.film is not None:
            if descriptor is None:
                raise ValueError("this model has FiLM: pass a stain descriptor (zeros for FiLM-Zero)")
            z = self.film(z, descriptor.to(z.dtype).expand(z.shape[0], -1))
        return z

    def head(self, cls: torch.Tensor, descriptor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, z) of encoder embeddings: the one definition of the pathway after the encoder."""
        z = self.adapt(cls, descriptor)
        return self.classifier(z), z

    def embed(self, pixels: torch.Tensor, descriptor: torch.Tensor | None = None) -> torch.Tensor:
        return self.adapt(self.encoder_embedding(pixels), descriptor)

    def forward(self, pixels: torch.Tensor, descriptor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.encoder_embedding(pixels), descriptor)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Exactly what is exchanged and checkpointed: the trainable tensors, detached."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        """The trainable tensors, and the folded base deltas a member state may carry (``fold_base``)."""
        from fedhisto.fedmath.lora_aggregators.fold import split_folded

        state, folded = split_folded(state)
        own = {n: p for n, p in self.named_parameters() if p.requires_grad}
        if set(state) != set(own):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise ValueError(f"trainable state does not fit the model: missing {missing[:4]}, unexpected {extra[:4]}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(state[n])
        self.fold_base(folded)

    @torch.no_grad()
    def fold_base(self, folded: dict[str, torch.Tensor]) -> None:
        """Each frozen weight named in ``folded`` becomes its pristine value plus that offset (FedEx-LoRA's
        fold, ``fedmath.lora_aggregators.fold``); a weight folded before and not named now is restored, so
        the state loaded last is the whole model. The pristine weights are kept from the first fold on."""
        pristine = self.__dict__.setdefault("_pristine_base", {})
        if not folded and not pristine:
            return
        frozen = {n: p for n, p in self.named_parameters() if not p.requires_grad}
        for name, delta in folded.items():
            p = frozen.get(name)
            if p is None or tuple(delta.shape) != tuple(p.shape):
                raise ValueError(f"folded base delta {name!r} {tuple(delta.shape)} fits no frozen weight of the "
                                 f"model{'' if p is None else f' (it is {tuple(p.shape)})'}")
            if name not in pristine:
                pristine[name] = p.detach().clone()
            p.copy_(pristine[name].to(p.device) + delta.to(p.device, p.dtype))
        for name in [n for n in pristine if n not in folded]:
            frozen[name].copy_(pristine.pop(name))


def parameter_counts(model: FedHistoModel) -> dict[str, int]:
    """Parameter counts per component (works on the meta device, so no weights are needed)."""
    def count(params) -> int:
        return sum(p.numel() for p in params)

    lora = count(p for n, p in model.encoder.named_parameters() if "lora_" in n)
    backbone = count(p for n, p in model.encoder.named_parameters() if "lora_" not in n)
    parts = {
        "backbone": backbone,
        "lora": lora,
        "lora_modules": sum(1 for n, _ in model.encoder.named_modules() if n.endswith("lora_A")),
        "adapter": count(model.adapter.parameters()),
        "film": count(model.film.parameters()) if model.film is not None else 0,
        "classifier": count(model.classifier.parameters()),
    }
    parts["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    parts["total"] = count(model.parameters())
    return parts
