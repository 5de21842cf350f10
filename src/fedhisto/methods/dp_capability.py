"""Which runs can train under DP-SGD, and every refusal by name (imported by config validation).

DP-SGD clips each privacy unit's gradient, so it needs a local objective that is a sum of per-unit
terms whose value depends on that unit's images alone (given the round's public inputs: the
global state and the server's payload). It also needs every OTHER upload a method makes from the
site's images to be noised or absent, or the guarantee covers the model state only.

Each method declares this itself, in its own file (``Method.dp_refusal`` and
``Method.private_objective``, see ``fedhisto.methods.dp_objective``): nothing here names a method. A
method that declares nothing is refused. The methods are built only when ``privacy.enabled`` is true,
so parsing a configuration without DP imports no method.
"""

from __future__ import annotations

from typing import Any

#: The batched engine forwards every client's views in one pass with masks drawn once for the stack;
#: DP-SGD is built for the sequential engine only.
DP_ENGINES = ("sequential",)
#: The sequential engine runs DP-SGD (``train.private``: ``per_sample`` + ``dpsgd`` + ``accountant``). Were it
#: False, ``privacy.enabled: true`` would be refused rather than silently train without privacy.
ENGINE_RUNS_DP = True


def method_refusal(name: str, cfg: Any) -> str | None:
    """Why method ``name`` cannot train under DP-SGD with ``cfg`` (None: it can), in the method's own words."""
    from fedhisto.methods import build_method

    try:
        method = build_method(name, cfg)
    except ImportError as exc:
        return f"its class cannot be imported ({exc}), so it declares no objective of one image"
    return method.dp_refusal()


def privacy_refusals(methods: list[str], engine: str, cfg: Any) -> list[str]:
    """Every reason ``privacy.enabled: true`` cannot run with these methods and engine, one line each."""
    out = []
    if not ENGINE_RUNS_DP:
        out.append("privacy.enabled: DP-SGD is not yet wired into the local training loop (fedhisto.privacy "
                   "holds its parts); refusing rather than training without privacy")
    if engine not in DP_ENGINES:
        out.append(f"train.engine: {engine!r} cannot run DP-SGD; set train.engine: sequential (the batched "
                   "engine stacks every client's views in one pass and computes no per-unit gradients)")
    for name in methods:
        why = method_refusal(name, cfg)
        if why:
            out.append(f"method {name!r} cannot train under DP-SGD: {why}")
    return out


def budget_refusal(cfg: Any, methods: list[str]) -> str | None:
    """Why the budget cannot be met by a method's plan (None: it can, or no budget). Epsilon per round
    depends on the noise multipliers, q, steps, delta and whether the method uploads after aggregation
    (the noised prototype release), not on a site's size, so this holds for every site; the site-level
    check (delta below 1/units) runs when the run starts (``accountant.check_plan``)."""
    from fedhisto.methods import build_method
    from fedhisto.privacy.accountant import PrivacyBudgetExceeded, check_plan
    from fedhisto.privacy.releases import releases_of

    p = cfg.privacy
    if p.target_epsilon is None:
        return None
    for name in methods:
        releases = releases_of(p, cfg.train.local_epochs, bool(build_method(name, cfg).post_uploads))
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
    problems = privacy_refusals(methods, cfg.train.engine, cfg)
    budget = budget_refusal(cfg, [m for m in methods if not any(f"method {m!r} " in line for line in problems)])
    if budget:
        problems.append(budget)
    if problems:
        raise ValueError("privacy.enabled is true but:\n    " + "\n    ".join(problems))
