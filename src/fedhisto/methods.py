"""What each federated method switches on (study Table 3, plus the FedStain comparator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MethodSpec:
    film: bool                   # stain-conditioned FiLM module present
    zero_descriptor: bool        # FiLM-Zero: the descriptor is replaced by zeros
    prototypes: Literal["none", "v1", "v2"]
    paired_views: bool           # two stain-counterfactual views per image
    use_js: bool
    use_feat: bool
    aggregation: Literal["sample_mass", "adaptive"]
    proximal: bool               # FedProx penalty
    style_exchange: bool = False  # FedStain: style statistics exchange, RandStain/AugMix/MixStyle, SupCon + JS


METHODS: dict[str, MethodSpec] = {
    "fedavg_peft": MethodSpec(False, False, "none", False, False, False, "sample_mass", False),
    "fedprox_peft": MethodSpec(False, False, "none", False, False, False, "sample_mass", True),
    "film_zero": MethodSpec(True, True, "none", False, False, False, "sample_mass", False),
    "past_v1": MethodSpec(True, False, "v1", False, False, False, "adaptive", False),
    "past_v2": MethodSpec(True, False, "v2", True, True, True, "adaptive", False),
    "v2_no_js": MethodSpec(True, False, "v2", True, False, True, "adaptive", False),
    "v2_no_feat": MethodSpec(True, False, "v2", True, True, False, "adaptive", False),
    "v2_no_proto": MethodSpec(True, False, "none", True, True, True, "adaptive", False),
    # the comparator from papers/fedstain.txt on the same PEFT architecture as fedavg_peft (no FiLM)
    "fedstain": MethodSpec(False, False, "none", False, False, False, "sample_mass", False, style_exchange=True),
}


def method_spec(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}") from None
