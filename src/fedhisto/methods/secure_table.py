"""The generated table of secure aggregation: per registered method, whether it runs, what the coordinator
learns, what a site uploads masked, how far the result is from the in-process aggregate, and how many
sites a masked sum may lose (the block ``secure_aggregation`` of docs/methods.md, written by ``fedhisto records``).

Everything comes from the registry and each method's own declaration (``Strategy.secure_aggregation``)
and hooks, on the real tensors' shapes: the tiny encoder's model as the given config builds it, and
HIBOU-B's (``model.parameter_card.meta_model``: the real architecture on the meta device, no weights).
Bytes are what Flower's SecAgg+ sends for the masked vectors: every array's values as 64-bit field
elements in NumPy's ``.npy`` format (``flwr.common.ndarray_to_bytes``), plus the weight factor it
prepends; the key exchange (two public keys, a ciphertext per other site, the shares at unmasking) is
a few hundred bytes per site and masked sum and is not counted.
"""

from __future__ import annotations

import io
import math
import re
from typing import Any

import numpy as np
import torch

MIB = 2 ** 20
FIELD = "<i8"  # Flower sends masked values as int64 after the modulo


def npy_bytes(shape: tuple[int, ...], descr: str = FIELD) -> int:
    """Bytes of ``np.save`` of an array of ``shape`` and ``descr`` (header included), without allocating it."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": tuple(shape)})
    return buf.tell() + np.dtype(descr).itemsize * math.prod(shape)


def masked_bytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """One site's masked vector as SecAgg+ sends it: the weight factor, then every term's array."""
    return npy_bytes((1,)) + sum(npy_bytes(shape) for _, shape in shapes)


def secagg_threshold(sites: int, num_shares: float, threshold: float) -> tuple[int, int]:
    """(shares, threshold) as Flower 1.42's ``SecAggPlusWorkflow.setup_stage`` sets them for ``sites``."""
    shares = round(num_shares * sites)
    if shares < sites and shares % 2 == 0:
        shares += 1
    if shares <= 2:
        shares = sites
    return shares, max(round(threshold * shares), 2)


def round_bytes(method: Any, model: Any) -> tuple[int, int]:
    """(masked upload, the trainable state's bytes) of one site in one round, from ``model``'s tensors."""
    from fedhisto.fedmath.prototypes import ClientPrototypes, prototype_terms
    from fedhisto.fedmath.secure_sums import layout

    decl = method.secure_aggregation()
    state = model.trainable_state()
    plain = sum(t.numel() * t.element_size() for t in state.values())
    dim = model.classifier.in_features
    if not decl.runs or not decl.exchanges:
        return 0, plain
    scaling = model.lora_scaling
    masked = masked_bytes(layout(method.objective.secure_terms(state, state, scaling)))
    if decl.weights == "statistics":
        masked += masked_bytes(layout(method.objective.secure_statistic(state, state, scaling))) + 16  # + the two scalars
    if method.post_uploads:
        upload = ClientPrototypes({c: torch.zeros(dim) for c in range(3)}, {c: 1 for c in range(3)})
        masked += masked_bytes(layout(prototype_terms(upload, 3, dim, 1)))
    return masked, plain


#: What every method exchanging a model lets the coordinator learn besides the sum (said once, in the header).
PUBLIC_COUNTS = "each site's sample count n_k (public since site preparation)"


def _mib(n: int) -> str:
    return f"{n / MIB:.3f}"


def secure_aggregation_rows(cfg: Any, sites: int = 5) -> list[tuple[str, ...]]:
    """The table's rows for ``cfg`` (the tiny encoder's model settings and the secure-aggregation settings)
    with ``sites`` sites, every one returning: (methods, runs, learns, masked MiB, difference, sites a sum
    may lose); methods whose declarations give the same cells share one row (the ablations, the FedAvg-style
    family), in registry order."""
    from fedhisto.config.study import ModelConfig
    from fedhisto.fedmath.secure_sums import Quantiser, mean_bound
    from fedhisto.methods import build_method, method_names, registration
    from fedhisto.model.parameter_card import meta_model

    s = cfg.secure_aggregation
    bound = mean_bound(Quantiser(s.clipping_range, s.quantization_levels), sites, 1.0)
    _, threshold = secagg_threshold(sites, s.num_shares, s.reconstruction_threshold)
    models: dict[tuple[str, bool], Any] = {}  # the trainable state depends on the encoder and FiLM only

    def model_of(encoder: str, name: str, model_cfg: Any):
        key = (encoder, bool(registration(name).attribute("film", False)))
        if key not in models:
            models[key] = meta_model(encoder, name, model_cfg)
        return models[key]

    rows: dict[tuple[str, ...], list[str]] = {}  # a row's cells after the first -> the methods sharing them
    for name in method_names():
        method = build_method(name, cfg)
        decl = method.secure_aggregation()
        if not decl.runs:
            rows.setdefault(("no", f"refused: {decl.refusal.replace(name, 'it')}", "-", "-", "-"), []).append(name)
            continue
        if not decl.exchanges:
            rows.setdefault(("not applicable: runs as without", "; ".join(decl.learns), "none", "none", "-"),
                            []).append(name)
            continue
        sizes = [round_bytes(method, model_of(enc, name, mc)) for enc, mc in (("tiny", cfg.model),
                                                                              ("hibou-b", ModelConfig()))]
        masked = f"{_mib(sizes[0][0])} / {_mib(sizes[1][0])} ({_mib(sizes[0][1])} / {_mib(sizes[1][1])})"
        sums = [f"w_k x ({decl.summed})"]
        if decl.weights == "statistics":
            sums.insert(0, "D_k")
        if decl.masked_sums > len(sums):
            sums.append("post-aggregation uploads")
        how = {"public_counts": "w_k from the stated counts", "uniform": "uniform w_k",
               "statistics": "w_k from a first masked sum"}[decl.weights]
        runs = f"yes; {how}; masked sums: " + "; ".join(f"({i}) {x}" for i, x in enumerate(sums, 1))
        learns = "; ".join(x for x in decl.learns if x != PUBLIC_COUNTS) or "nothing more"
        diff = f"<= {bound:.1e} per value"
        if "s B_k A_k" in decl.summed and "A_k, B_k" not in decl.summed:  # refactorised from the dense sum
            diff += "; factors up to sign"
        if decl.weights == "statistics":
            diff += "; w_k from the quantised S"
        least = max(2, decl.min_sites, threshold)
        rows.setdefault((runs, learns, masked, diff, f"{max(sites - least, 0)} of {sites}"), []).append(name)
    return [(", ".join(names), *cells) for cells, names in rows.items()]


def _markdown(header: list[str], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def secure_aggregation_table(cfg: Any, sites: int = 5) -> str:
    """The markdown table (see the module docstring) of ``secure_aggregation_rows(cfg, sites)``."""
    return _markdown(["methods", "runs under secure aggregation", "what the coordinator learns beyond the weighted "
                      "sum over the sites that answered and each site's sample count n_k (public)", "masked upload "
                      "per site and round, MiB: tiny / HIBOU-B (trainable state)", "difference from the in-process "
                      f"aggregate ({sites} sites)", "sites a sum may lose"], secure_aggregation_rows(cfg, sites))


#: The name of the generated block in docs/methods.md.
BLOCK = "secure_aggregation"
#: The tiny encoder's model as the embedded default (config/config.yaml) builds it; HIBOU-B's is the study's.
TINY_MODEL = {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 32, "film_hidden": 32}


def _guide_config() -> Any:
    """Every registered method, the default secure-aggregation settings, the embedded default's tiny model
    (and, in the traffic column, the study's HIBOU-B model)."""
    from fedhisto.config.study import load_config

    return load_config({"model": TINY_MODEL})


def render_secure_aggregation() -> str:
    """The methods guide's block: the whole table, five sites."""
    return secure_aggregation_table(_guide_config(), sites=5)


def render_what_the_coordinator_learns() -> str:
    """The federation guide's view of the same rows: who runs, what the coordinator learns, the dropouts
    (the traffic and precision columns stay in the methods guide's ``secure_aggregation`` block)."""
    rows = secure_aggregation_rows(_guide_config(), sites=5)
    return _markdown(["methods", "runs", "what the coordinator learns beyond the weighted sum and the counts n_k",
                      "sites a sum may lose"], [(r[0], re.split(r"[;:]", r[1])[0], r[2], r[5]) for r in rows])


def with_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between ``<!-- generated:NAME begin -->`` and ``... end -->`` replaced by ``body``."""
    begin, end = f"<!-- generated:{name} begin -->", f"<!-- generated:{name} end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {begin} ... {end} pair")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}{end}{tail}"


def block_of(text: str, name: str) -> str:
    """The lines between the two markers of block ``name`` (what ``with_block`` wrote)."""
    begin, end = f"<!-- generated:{name} begin -->\n", f"<!-- generated:{name} end -->"
    return text.split(begin, 1)[1].split(end, 1)[0]
