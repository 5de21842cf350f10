"""Which methods run under secure aggregation, what each one's server step receives, and every refusal by name.

Under ``secure_aggregation.enabled`` the coordinator never holds a site's update: each site uploads
its contribution masked (Flower's SecAgg+ on a real federation), and the server step receives the
weighted sum over the sites that answered (:class:`SecureSums`). A method says in its own file what
its server step needs (``Strategy.secure_aggregation``, a :class:`SecureAggregation`):

- **public weights** (sample counts, or uniform): the server forms the weights from what the sites
  state in the clear and sends each its own before masking;
- **a first masked round of statistics** (PAST's adaptive weights): the sites' update vectors are summed
  masked, each site computes the scalars its weight needs from that sum, and a second masked round
  sums the weighted contributions;
- **products**: a method whose server step needs ``sum_k a_k s B_k A_k`` (delta-SVD, FlexLoRA, FedEx-LoRA,
  FedAdam) has each site mask its dense products (``fedmath.secure_sums.Product``);
- or it is **refused**, naming what the coordinator would have to see.

Nothing here names a method. A method that declares nothing is refused. The methods are built only
when ``secure_aggregation.enabled`` is true, so parsing a configuration without it imports no method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

#: How a method's aggregation weights are formed under secure aggregation.
WEIGHTS = {
    "public_counts": "sample mass from each site's count n_k, stated in the clear",
    "uniform": "equal weights of the sites that answered",
    "statistics": "a first masked round of the updates, then per-site scalars",
}


@dataclass(frozen=True)
class SecureAggregation:
    """A method's declaration: whether its server step can be written over masked sums, and how."""

    runs: bool
    weights: Literal["public_counts", "uniform", "statistics"] = "public_counts"
    summed: str = ""              # what each site masks, in words (the table's "what is summed")
    learns: tuple[str, ...] = ()  # what the coordinator learns beyond the weighted sum, in words
    masked_sums: int = 1          # masked sums per round (training statistics, contribution, post uploads)
    min_sites: int = 2            # fewest sites a masked sum may cover (fewer would reveal a site's vector)
    refusal: str | None = None    # why not: what the coordinator would have to see in the clear

    exchanges: bool = True        # False: nothing leaves a site (local_only) or nothing is federated (pooled)

    @classmethod
    def refused(cls, why: str) -> SecureAggregation:
        return cls(runs=False, refusal=why)

    @classmethod
    def not_applicable(cls, why: str) -> SecureAggregation:
        """A reference that aggregates nothing: it runs as it does without secure aggregation."""
        return cls(runs=True, summed="nothing", learns=(why,), masked_sums=0, exchanges=False)


@dataclass
class SecureSums:
    """What a server step receives under secure aggregation: weighted sums over the sites that
    answered, and public facts of the round; never a site's record.

    ``sums[name]`` is ``sum_k a_k t_k`` (float64) of the term ``name`` over ``sites`` (the survivors of
    the masked round) with the weights ``weights`` the server assigned before masking; ``mean`` divides
    by their total. ``start`` is the round's global start state (the server's own)."""

    round_idx: int
    sums: dict[str, Any]
    weights: dict[str, float]
    start: dict[str, Any]
    server_state: Any = None
    bound: float = 0.0            # largest quantisation error of a value of ``mean`` (fedmath.secure_sums.mean_bound)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sites(self) -> list[str]:
        return sorted(self.weights)

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights.values()))

    def mean(self, name: str):
        return self.sums[name] / self.total_weight


@dataclass(frozen=True)
class SiteStatistics:
    """The scalars a site states in the clear for statistics-round weights: its sample count, the
    squared norm of its update D_k and the dot product of D_k with the masked sum S of every
    site's D (``reference``: ||S||^2 and the number of sites in S)."""

    counts: dict[str, int]
    squared_norms: dict[str, float]
    dots: dict[str, float]
    sum_squared_norm: float
    summed_sites: int


def method_declaration(name: str, cfg: Any) -> SecureAggregation:
    from fedhisto.methods import build_method

    try:
        method = build_method(name, cfg)
    except ImportError as exc:
        return SecureAggregation.refused(f"its class cannot be imported ({exc})")
    return method.secure_aggregation()


def secure_refusals(methods: list[str], cfg: Any) -> list[str]:
    """Every reason ``secure_aggregation.enabled: true`` cannot run these methods, one line each."""
    out = []
    for name in methods:
        decl = method_declaration(name, cfg)
        if not decl.runs:
            out.append(f"method {name!r} cannot run under secure aggregation: {decl.refusal}")
    return out


def check_secure(cfg: Any) -> None:
    """Raise ValueError listing every refusal when ``cfg.secure_aggregation.enabled`` (``entry.study_config``)."""
    if not cfg.secure_aggregation.enabled:
        return
    methods = list(dict.fromkeys([*cfg.train.methods, *cfg.train.ablations]))
    problems = secure_refusals(methods, cfg)
    if problems:
        raise ValueError("secure_aggregation.enabled is true but:\n    " + "\n    ".join(problems))
