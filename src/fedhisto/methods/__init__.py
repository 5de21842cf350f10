"""Federated methods as registered strategies (see ``base.Method`` for the hooks).

Built-in methods are registered here by import path, so that importing this package (as the
Snakefile does to validate names and build wildcard constraints) never imports torch. Register
your own with :func:`register` (a class or ``"module:Class"``), as README's "Adding a method" shows.
"""

from __future__ import annotations

from typing import Any

from fedhisto.methods.registry import (
    Registration,
    method_names,
    register,
    registration,
    unregister,
    wildcard_pattern,
)

__all__ = ["Registration", "build_method", "method_names", "register", "registration", "unregister",
           "wildcard_pattern"]

_PAST = "fedhisto.methods.past:PastFamily"
# The study's Table 3, one keyword-named switch row per method.
register("fedavg_peft", _PAST, "past")
register("fedprox_peft", _PAST, "past", proximal=True)
register("film_zero", _PAST, "past", film=True, zero_descriptor=True)
register("past_v1", _PAST, "past", film=True, prototypes="v1", aggregation="adaptive")
register("past_v2", _PAST, "past", film=True, prototypes="v2", paired_views=True, js=True, feat=True,
         aggregation="adaptive")
register("v2_no_js", _PAST, "past", film=True, prototypes="v2", paired_views=True, js=False, feat=True,
         aggregation="adaptive")
register("v2_no_feat", _PAST, "past", film=True, prototypes="v2", paired_views=True, js=True, feat=False,
         aggregation="adaptive")
register("v2_no_proto", _PAST, "past", film=True, prototypes="none", paired_views=True, js=True, feat=True,
         aggregation="adaptive")
# The FedStain comparator (not in the study) on the same PEFT architecture as fedavg_peft, as its
# paper's Algorithm 1 prints it.
register("fedstain", "fedhisto.methods.fedstain:FedStain", "fedstain")
# FedStain as its authors' public code runs it (pixel-level statistics and shift, three views).
register("fedstain_code", "fedhisto.methods.fedstain_code:FedStainCode", "fedstain_code")
# References every federated method is measured against (FLamby reports both).
register("local_only", "fedhisto.methods.local_only:LocalOnly")
register("pooled", "fedhisto.methods.pooled:Pooled")


def build_method(name: str, cfg: Any) -> Any:
    """The method object of a run (a ``methods.base.Method``) for a ``config.Config``: its registered class
    with its registered options. Untyped here so that this package imports neither (config validates
    method names against this registry)."""
    reg = registration(name)
    return reg.method_class()(name, cfg, reg.config_key, **reg.options)
