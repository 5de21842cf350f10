"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II) against the paper's algorithm written
afresh in numpy, on its client-drift toy: clients with quadratic losses f_i whose local optima differ,
K local steps each round, every client every round, the server's x <- x + (1/|S|) sum_i (y_i - x) and
c <- c + (1/N) sum_i (c_i+ - c_i) with c_i+ = c_i - c + (x - y_i) / (K eta_l). fedhisto's method runs
through the round driver; each client's K steps are the engine's optimiser on f_i plus the method's
own correction term.

- a plain parameter: the trajectory (x, c, every c_i) is Algorithm 1's, and reaches the global optimum;
- a LoRA pair (W = s B A, the losses 0.5 h_i ||W - O_i||^2 with the optimum W* of rank r): with the
  method's rebalancing of each round's factor mean and without it (Algorithm 1 on the factors), both
  reach W*; and, round by round, the method's W is Algorithm 1's with each mean refactorised to the
  balanced split (numpy's SVD) and the variates moved as gradients move under B' = B M, A' = M^-1 A
  (c_B' = c_B M^-T, c_A' = M^T c_A);
- ``scaffold_adamw``: the same server after AdamW local steps (Loshchilov & Hutter's decoupled weight
  decay, written afresh), the reading the method's registration names.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from reference_support import (
    Reference,
    build,
    check,
    config,
    control_variates,
    corrected_steps,
    drive_round,
    local_optimizer,
    local_schedule,
)

pytestmark = pytest.mark.reference

REFERENCES = [
    Reference("method", "scaffold", "Algorithm 1 (option II) in numpy on the drift toy: x, c, c_i each round",
              "test_plain_parameter_trajectory_is_algorithm_1"),
    Reference("method", "scaffold", "the LoRA drift toy: Algorithm 1 on the factors without rebalancing; both reach W*",
              "test_lora_toy_with_and_without_rebalancing_reaches_the_optimum"),
    Reference("method", "scaffold", "Algorithm 1 with numpy's balanced refactorisation and the gradient transport",
              "test_lora_toy_trajectory_is_algorithm_1_in_the_rebalanced_basis"),
    Reference("method", "scaffold_adamw", "option II after AdamW local steps (decoupled weight decay) in numpy",
              "test_scaffold_adamw_is_option_ii_after_adamw_steps"),
]

S = 2.0  # the LoRA scaling of the pair


# ------------------------------------------------------------------ the plain toy
# three clients, f_i(x) = 0.5 (x - o_i)^T H_i (x - o_i) with diagonal H_i: the global optimum of the mean is
# x* = (sum_i H_i)^-1 sum_i H_i o_i, away from every client's own optimum
H = [np.array([1.0, 0.5]), np.array([3.0, 1.0]), np.array([0.5, 2.5])]
OPTIMA = [np.array([0.0, 2.0]), np.array([4.0, -1.0]), np.array([-2.0, 3.0])]
X_STAR = sum(h * o for h, o in zip(H, OPTIMA, strict=True)) / sum(H)
SITES = ("C1", "C2", "C3")


def _plain_local(method, steps: int, grad_of):
    """A participant's K local steps with the engine's optimiser on f_i plus the method's correction."""
    def local(name, start, payload):
        i = SITES.index(name)
        params = {"p": torch.nn.Parameter(start["p"].clone())}
        opt = local_optimizer(method, [params["p"]])
        with corrected_steps(method, payload, params, start, steps) as extra:
            for k in range(steps):
                opt.zero_grad()
                h, o = torch.from_numpy(H[i]), torch.from_numpy(OPTIMA[i])
                (0.5 * (h * (params["p"] - o) ** 2).sum() + extra(k)).backward()
                opt.step()
        return {"p": params["p"].detach().clone()}, 10, steps

    return local


def _rounds(method, local, x0: np.ndarray, rounds: int):
    """Every round's (x, c, {c_i}) of the method through the round driver."""
    model = SimpleNamespace(lora_scaling=S)
    members, state, out = {"global": {"p": torch.from_numpy(x0.copy())}}, None, []
    for t in range(rounds):
        got = drive_round(method, model, members, list(SITES), local, server_state=state, round_idx=t)
        members, state = got.members, got.server_state
        c, ci = control_variates(state)
        out.append((members["global"]["p"].numpy(), c["p"].numpy(), {n: v["p"].numpy() for n, v in ci.items()}))
    return out


def algorithm_1(x0: np.ndarray, rounds: int, steps: int, lr: float, client_step=None):
    """Karimireddy et al.'s Algorithm 1, option II, eta_g = 1, every client every round (|S| = N = 3).
    ``client_step(i, y, corrected gradient, k)``: one local step (plain SGD by default)."""
    step = client_step or (lambda i, y, g, k: y - lr * g)
    x, c = x0.copy(), np.zeros_like(x0)
    ci = [np.zeros_like(x0) for _ in SITES]
    out = []
    for _ in range(rounds):
        ys, new = [], []
        for i in range(len(SITES)):
            y = x.copy()
            for k in range(steps):
                y = step(i, y, H[i] * (y - OPTIMA[i]) - ci[i] + c, k)
            ys.append(y)
            new.append(ci[i] - c + (x - y) / (steps * lr))
        c = c + sum(n - old for n, old in zip(new, ci, strict=True)) / len(SITES)
        ci, x = new, sum(ys) / len(SITES)
        out.append((x.copy(), c.copy(), {n: v.copy() for n, v in zip(SITES, ci, strict=True)}))
    return out


def test_plain_parameter_trajectory_is_algorithm_1(request):
    lr, steps, x0 = 0.1, 10, np.array([1.0, 1.0])
    method = build("scaffold", config(train={"scaffold": {"local_lr": lr}}))
    ours = _rounds(method, _plain_local(method, steps, None), x0, 150)
    ref = algorithm_1(x0, 150, steps, lr)
    worst = 0.0
    for (x, c, ci), (rx, rc, rci) in zip(ours, ref, strict=True):
        worst = max(worst, float(np.abs(x - rx).max()), float(np.abs(c - rc).max()),
                    *(float(np.abs(ci[n] - rci[n]).max()) for n in SITES))
    assert float(np.abs(ref[-1][0] - X_STAR).max()) < 1e-10  # the algorithm cancels the drift
    worst = max(worst, float(np.abs(ours[-1][0] - X_STAR).max()))
    check(request, "method", "scaffold", worst, 1e-10)


def test_scaffold_adamw_is_option_ii_after_adamw_steps(request):
    """The study's AdamW schedule (here lr 0.05, weight decay 1e-4; betas 0.9, 0.999 and eps 1e-8, the
    optimiser's defaults) on the corrected gradient g_i - c_i + c, a fresh optimiser every round (the
    engines build one per round), and option II's variates from the returned states."""
    lr, wd, steps, x0 = 0.05, 1e-4, 6, np.array([1.0, 1.0])
    method = build("scaffold_adamw", config(train={"lr": lr, "weight_decay": wd}))
    plan = local_schedule(method)
    assert (plan.optimizer, plan.lr, plan.weight_decay) == ("adamw", lr, wd)
    moments: dict[int, tuple] = {}

    def adamw(i, y, g, k):
        m, v = moments.get(i, (0.0, 0.0)) if k else (0.0, 0.0)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        moments[i] = (m, v)
        y = y * (1 - lr * wd)
        return y - lr * (m / (1 - 0.9 ** (k + 1))) / (np.sqrt(v / (1 - 0.999 ** (k + 1))) + 1e-8)

    ours = _rounds(method, _plain_local(method, steps, None), x0, 12)
    ref = algorithm_1(x0, 12, steps, lr, client_step=adamw)
    worst = 0.0
    for (x, c, ci), (rx, rc, rci) in zip(ours, ref, strict=True):
        worst = max(worst, float(np.abs(x - rx).max()), float(np.abs(c - rc).max()),
                    *(float(np.abs(ci[n] - rci[n]).max()) for n in SITES))
    check(request, "method", "scaffold_adamw", worst, 1e-10)


# ------------------------------------------------------------------ the LoRA toy
A_KEY, B_KEY = "m.lora_A.default.weight", "m.lora_B.default.weight"
RANK, OUT, IN = 2, 4, 3
_g = np.random.default_rng(0)
_P, _Q = np.linalg.qr(_g.normal(size=(OUT, RANK)))[0], np.linalg.qr(_g.normal(size=(IN, RANK)))[0]
_D = _g.normal(size=(RANK, RANK))
_CORE = np.diag([1.0, 0.6])
# h_1 = 1, h_2 = 3: W* = (O_1 + 3 O_2) / 4 = P diag(1, 0.6) Q^T, of rank 2; the clients' optima differ by D
LORA_SITES = {"C1": (1.0, _P @ (_CORE + _D) @ _Q.T), "C2": (3.0, _P @ (_CORE - _D / 3) @ _Q.T)}
W_STAR = _P @ _CORE @ _Q.T
B0 = _g.normal(size=(OUT, RANK)) * np.array([1.5, 0.5])     # an unbalanced start: B^T B far from A A^T
A0 = _g.normal(size=(RANK, IN)) * np.array([[0.2], [0.6]])
LORA_LR, LORA_STEPS = 0.03, 5


def _pair_gradients(a, b, h, o):
    residual = h * (S * b @ a - o)
    return S * b.T @ residual, S * residual @ a.T


def _factor_algorithm_1(rounds: int, rebalance: bool) -> list[np.ndarray]:
    """Algorithm 1 on the factors (A, B); with ``rebalance`` each round's mean is refactorised to the
    balanced split of its product (B' = U sqrt(S/s), A' = sqrt(S/s) V^T from numpy's SVD), M solved from
    B' = B M, and every variate moved as a gradient: c_B M^-T, M^T c_A. Returns each round's s B A."""
    a, b = A0.copy(), B0.copy()
    zero = {"a": np.zeros_like(a), "b": np.zeros_like(b)}
    c, ci = dict(zero), {n: dict(zero) for n in LORA_SITES}
    out = []
    for _ in range(rounds):
        ys, deltas = [], []
        for n, (h, o) in LORA_SITES.items():
            ya, yb = a.copy(), b.copy()
            for _ in range(LORA_STEPS):
                ga, gb = _pair_gradients(ya, yb, h, o)
                ya, yb = ya - LORA_LR * (ga - ci[n]["a"] + c["a"]), yb - LORA_LR * (gb - ci[n]["b"] + c["b"])
            new = {"a": ci[n]["a"] - c["a"] + (a - ya) / (LORA_STEPS * LORA_LR),
                   "b": ci[n]["b"] - c["b"] + (b - yb) / (LORA_STEPS * LORA_LR)}
            deltas.append({k: new[k] - ci[n][k] for k in new})
            ci[n] = new
            ys.append((ya, yb))
        a, b = np.mean([y[0] for y in ys], 0), np.mean([y[1] for y in ys], 0)
        c = {k: c[k] + sum(d[k] for d in deltas) / len(LORA_SITES) for k in c}
        if rebalance:
            u, sv, vt = np.linalg.svd(S * b @ a, full_matrices=False)
            root = np.sqrt(sv[:RANK] / S)
            b_new, a_new = u[:, :RANK] * root, root[:, None] * vt[:RANK]
            m = np.linalg.lstsq(b, b_new, rcond=None)[0]
            m_inv = np.linalg.inv(m)
            for v in (c, *ci.values()):
                v["b"], v["a"] = v["b"] @ m_inv.T, m.T @ v["a"]
            a, b = a_new, b_new
        out.append(S * b @ a)
    return out


def _method_lora(rounds: int) -> list[np.ndarray]:
    """fedhisto's scaffold on the LoRA toy through the round driver; each round's s B A."""
    method = build("scaffold", config(train={"scaffold": {"local_lr": LORA_LR}}))

    def local(name, start, payload):
        h, o = LORA_SITES[name]
        target = torch.from_numpy(o)
        params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
        opt = local_optimizer(method, list(params.values()))
        with corrected_steps(method, payload, params, start, LORA_STEPS) as extra:
            for k in range(LORA_STEPS):
                opt.zero_grad()
                (0.5 * h * ((S * params[B_KEY] @ params[A_KEY] - target) ** 2).sum() + extra(k)).backward()
                opt.step()
        return {k: v.detach().clone() for k, v in params.items()}, 10, LORA_STEPS

    model = SimpleNamespace(lora_scaling=S)
    members = {"global": {A_KEY: torch.from_numpy(A0.copy()), B_KEY: torch.from_numpy(B0.copy())}}
    state, out = None, []
    for t in range(rounds):
        got = drive_round(method, model, members, list(LORA_SITES), local, server_state=state, round_idx=t)
        members, state = got.members, got.server_state
        out.append((S * members["global"][B_KEY] @ members["global"][A_KEY]).numpy())
    return out


def test_lora_toy_with_and_without_rebalancing_reaches_the_optimum(request):
    """400 rounds: Algorithm 1 on the factors as they are, and the method (which rebalances every round),
    both end at W* to float64 rounding: the client drift is cancelled either way."""
    plain = _factor_algorithm_1(400, rebalance=False)[-1]
    ours = _method_lora(400)[-1]
    assert float(np.abs(_factor_algorithm_1(5, rebalance=False)[-1] - W_STAR).max()) > 1e-2  # far at the start
    check(request, "method", "scaffold", max(float(np.abs(plain - W_STAR).max()), float(np.abs(ours - W_STAR).max())),
          1e-10)


def test_lora_toy_trajectory_is_algorithm_1_in_the_rebalanced_basis(request):
    """Thirty rounds from the unbalanced start: the method's s B A after every round against Algorithm 1
    with the balanced refactorisation and the gradient transport (numpy). The product is gauge-free,
    so the factors' signs (numpy's and torch's SVD may differ) do not enter."""
    ref = _factor_algorithm_1(30, rebalance=True)
    ours = _method_lora(30)
    check(request, "method", "scaffold", max(float(np.abs(x - y).max()) for x, y in zip(ours, ref, strict=True)),
          1e-12)
