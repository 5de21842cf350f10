"""Federated methods as registered strategies (see ``base.Method`` for the hooks).

Built-in methods are registered here by import path, so that importing this package (as the
Snakefile does to validate names and build wildcard constraints) never imports torch. Register
your own with :func:`register` (a class or ``"module:Class"``), as README's "Adding a method" shows.
"""

from __future__ import annotations

from typing import Any

from fedhisto.methods.registry import (
    Registration,
    default_comparisons,
    method_names,
    register,
    registration,
    settings_blocks,
    unregister,
    wildcard_pattern,
)

__all__ = ["Registration", "build_method", "default_comparisons", "method_names", "register", "registration", "settings_blocks",
           "unregister", "wildcard_pattern"]

_PAST = "fedhisto.methods.past:PastFamily"
_PAST_SETTINGS = {"config_key": "past", "settings": "fedhisto.methods.past:PastConfig"}
# The study's Table 3, one keyword-named switch row per method.
register("fedavg_peft", _PAST, **_PAST_SETTINGS)
register("fedprox_peft", _PAST, **_PAST_SETTINGS, proximal=True)
register("film_zero", _PAST, **_PAST_SETTINGS, film=True, zero_descriptor=True)
register("past_v1", _PAST, **_PAST_SETTINGS, film=True, prototypes="v1", aggregation="adaptive")
register("past_v2", _PAST, **_PAST_SETTINGS, film=True, prototypes="v2", paired_views=True, js=True, feat=True,
         aggregation="adaptive")
register("v2_no_js", _PAST, **_PAST_SETTINGS, film=True, prototypes="v2", paired_views=True, js=False, feat=True,
         aggregation="adaptive")
register("v2_no_feat", _PAST, **_PAST_SETTINGS, film=True, prototypes="v2", paired_views=True, js=True, feat=False,
         aggregation="adaptive")
register("v2_no_proto", _PAST, **_PAST_SETTINGS, film=True, prototypes="none", paired_views=True, js=True,
         feat=True, aggregation="adaptive")
# The FedStain comparator (not in the study) on the same PEFT architecture as fedavg_peft, as its
# paper's Algorithm 1 prints it.
register("fedstain", "fedhisto.methods.fedstain:FedStain", "fedstain", settings="fedhisto.methods.fedstain:FedStainConfig",
         comparison="v2_vs_fedstain")
# FedStain as its authors' public code runs it (pixel-level statistics and shift, three views).
register("fedstain_code", "fedhisto.methods.fedstain_code:FedStainCode", "fedstain_code",
         settings="fedhisto.methods.fedstain_code:FedStainCodeConfig", comparison="v2_vs_fedstain_code")
# SCAFFOLD (Karimireddy et al. 2020, option II) on fedavg_peft's model: control variates correct client drift.
register("scaffold", "fedhisto.methods.scaffold:Scaffold", "scaffold", settings="fedhisto.methods.scaffold:ScaffoldConfig",
         comparison="v2_vs_scaffold")
# FedAdam (Reddi et al. 2021; FedYogi/FedAdagrad via train.fedadam.variant): a server optimiser on the pseudo-gradient.
register("fedadam", "fedhisto.methods.fedadam:FedAdam", "fedadam", settings="fedhisto.methods.fedadam:FedAdamConfig",
         comparison="v2_vs_fedadam")
# References every federated method is measured against (FLamby reports both).
register("local_only", "fedhisto.methods.local_only:LocalOnly", comparison="v2_vs_local")  # does federation help?
register("pooled", "fedhisto.methods.pooled:Pooled", comparison="v2_vs_pooled")  # the centralised reference


def build_method(name: str, cfg: Any) -> Any:
    """The method object of a run (a ``methods.base.Method``) for a ``config.Config``: its registered class
    with its registered options. Untyped here so that this package imports neither (config validates
    method names against this registry)."""
    reg = registration(name)
    return reg.method_class()(name, cfg, reg.config_key, **reg.options)
