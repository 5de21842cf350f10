"""Which methods can train under DP-SGD, and every refusal by name (no torch import: config validation).

DP-SGD clips each privacy unit's gradient, so it needs a local objective that is a sum of per-unit
terms whose value depends on that unit's images alone (given the round's public inputs: the
global state and the server's payload). It also needs every OTHER upload a method makes from the
site's images to be noised or absent, or the guarantee covers the model state only.

- The PAST family (fedavg_peft, fedprox_peft, film_zero, past_v1/v2 and ablations): class-balanced CE
  per view, JS and feature consistency between one image's views, prototype terms against the GLOBAL
  prototypes (fixed during the round): per image (``unit_loss``). FedProx's proximal term has no
  data: its gradient joins after the noise. The prototype upload of v1/v2 (centroids of the site's
  embeddings every round) is refused unless ``privacy.prototypes: noised`` (``releases``).
- FedStain and fedstain_code: refused. Their representation alignment is a supervised contrastive
  loss (``fedmath.fedstain.supcon``): each image's term is normalised over the other images of the
  batch, so one image changes every other image's gradient and per-unit clipping bounds nothing;
  they also upload rows of style statistics of single images every round, in the clear.
- local_only and pooled: the fedavg_peft objective; nothing but the model leaves (or nothing at all).
- Any other registered method: refused until its class is listed here with a per-image objective.
"""

from __future__ import annotations

from typing import Any

from fedhisto.methods import registration

#: The batched engine forwards every client's views in one pass with masks drawn once for the stack;
#: DP-SGD is built for the sequential engine only.
DP_ENGINES = ("sequential",)
#: The sequential engine runs DP-SGD (``train.private``: ``per_sample`` + ``dpsgd`` + ``accountant``). Were it
#: False, ``privacy.enabled: true`` would be refused rather than silently train without privacy.
ENGINE_RUNS_DP = True

_PAST = "fedhisto.methods.past:PastFamily"
_REFUSED = {
    "fedhisto.methods.fedstain:FedStain": (
        "its loss does not decompose per sample: the representation alignment is a supervised contrastive "
        "loss (SupCon) whose every term is normalised over the other images of the batch; it also uploads "
        "single images' style statistics (train.fedstain.upload_ratio rows) un-noised"),
    "fedhisto.methods.fedstain_code:FedStainCode": (
        "its loss does not decompose per sample: the SupCon alignment of each generated view against the "
        "batch's originals couples the images of a batch; it also uploads single images' pixel skewness and "
        "kurtosis rows un-noised"),
}
_PER_SAMPLE = {"fedhisto.methods.local_only:LocalOnly", "fedhisto.methods.pooled:Pooled", _PAST}


def _target(name: str) -> str:
    target = registration(name).target
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def method_refusal(name: str, prototypes: str = "refuse") -> str | None:
    """Why method ``name`` cannot train under DP-SGD (None: it can)."""
    reg = registration(name)
    target = _target(name)
    if target in _REFUSED:
        return _REFUSED[target]
    if target not in _PER_SAMPLE:
        return (f"its class {target} is not known to have a per-sample objective; list it in "
                "fedhisto.privacy.support once its loss is written per image")
    if target == _PAST and reg.options.get("prototypes", "none") != "none" and prototypes != "noised":
        return ("it uploads class prototypes (centroids of the site's embeddings) every round, un-noised; set "
                "privacy.prototypes: noised to release them through the Gaussian mechanism")
    return None


def privacy_refusals(methods: list[str], engine: str, prototypes: str = "refuse") -> list[str]:
    """Every reason ``privacy.enabled: true`` cannot run with these methods and engine, one line each."""
    out = []
    if not ENGINE_RUNS_DP:
        out.append("privacy.enabled: DP-SGD is not yet wired into the local training loop (fedhisto.privacy "
                   "holds its parts); refusing rather than training without privacy")
    if engine not in DP_ENGINES:
        out.append(f"train.engine: {engine!r} cannot run DP-SGD; set train.engine: sequential (the batched "
                   "engine stacks every client's views in one pass and computes no per-unit gradients)")
    for name in methods:
        why = method_refusal(name, prototypes)
        if why:
            out.append(f"method {name!r} cannot train under DP-SGD: {why}")
    return out


def budget_refusal(cfg: Any, methods: list[str]) -> str | None:
    """Why the budget cannot be met by a method's plan (None: it can, or no budget). Epsilon per round
    depends on sigma, q, steps, delta and whether the method uploads noised prototypes, not on a site's
    size, so this holds for every site; the site-level check (delta below 1/units) runs when the run
    starts (``accountant.check_plan``)."""
    from fedhisto.privacy.accountant import PrivacyBudgetExceeded, check_plan
    from fedhisto.privacy.releases import round_releases

    p = cfg.privacy
    if p.target_epsilon is None:
        return None
    for name in methods:
        protos = registration(name).options.get("prototypes", "none") != "none"
        releases = round_releases(p.noise_multiplier, p.sample_rate, cfg.train.local_epochs, protos)
        try:  # n only enters the delta < 1/n check, made per site when the run starts: any n below 1/delta
            check_plan(name, max(1, int(0.5 / p.delta)), releases, cfg.train.max_rounds, p.delta,
                       p.target_epsilon, p.on_budget)
        except PrivacyBudgetExceeded as exc:
            return f"privacy.target_epsilon: method {name!r} (every site): {str(exc).removeprefix(f'site {name}: ')}"
    return None


def check_privacy(cfg: Any) -> None:
    """Raise ValueError listing every refusal when ``cfg.privacy.enabled`` (called by ``Config``'s validator)."""
    p = cfg.privacy
    if not p.enabled:
        return
    methods = list(dict.fromkeys([*cfg.train.methods, *cfg.train.ablations]))
    problems = privacy_refusals(methods, cfg.train.engine, p.prototypes)
    budget = budget_refusal(cfg, methods)
    if budget:
        problems.append(budget)
    if problems:
        raise ValueError("privacy.enabled is true but:\n    " + "\n    ".join(problems))
