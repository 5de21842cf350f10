"""Stage ``accounting``: communication per round from the real tensor shapes and messages.

Float32, MiB = 2**20 bytes, download + upload, all clients, per round (study section 4.7).

Messages per round and client:
- model: the trainable state down (global) and up (client update);
- prototypes (v1/v2 family): up, one centroid (D floats) and its count (1 float) per locally
  available class; down, the global centroids of valid classes (D floats each), the
  per-class reliability (C floats) and availability mask (C bytes).
- style statistics (fedstain): up, ceil(r n_i) rows of 3 pixel means, 3 pixel deviations and
  the block features' skewness and kurtosis (2 D floats); down, every other client's rows.
- style statistics (fedstain_code, as the authors' code): up, floor(r n_i) rows of 3 pixel
  skewness and 3 pixel kurtosis floats (the code's only upload; no mean/std, no features);
  down, every other client's rows.
  n_i is the planned optimisation size (pool minus holdout); holdouts drawn in whole duplicate
  families can move a realised count by a few images (results/manifest/composition.csv).
- control variates (scaffold): c and the client's c_i down (a deployment that keeps c_i at the
  site: c down, delta c_i up), each the size of the trainable state; a kind without a column of
  its own, so it is summed into ``other_extra_per_round_mib`` and named in ``other_extra_kinds``.
- the model exchange itself is the method's ``model_bytes`` (default: the trainable state down and up
  per client; the LoRA aggregators count what their protocol sends: FFA-LoRA without A, FedSA-LoRA
  without B, FlexLoRA at each site's rank; ``fedmath.lora_aggregators``).
One-time: each client's 14-d stain descriptor, up once.

The study's Table 8 (41.615891 MiB for v1/v2) matches centroids+counts up and centroids
down exactly; this implementation also downloads reliability and mask, which the clients
need for the v2 loss: 75 bytes per round with five clients, 0.00007 MiB (see the CSV's
``prototype_residual_vs_study_mib`` column).
"""

from __future__ import annotations

from pathlib import Path

from fedhisto.config.stage_blocks import stage_block
from fedhisto.config.study import Config
from fedhisto.fedmath.prototypes import PrototypeTraffic, prototype_traffic  # noqa: F401 - re-exported
from fedhisto.infra.atomic import write_csv
from fedhisto.infra.provenance import provenance_block, write_sidecar
from fedhisto.manifest.targets import client_holdouts
from fedhisto.methods import build_method
from fedhisto.model.parameter_card import meta_model, model_card
from fedhisto.model.peft_model import DESCRIPTOR_DIM

STAGE = "accounting"
MIB = 2**20
FLOAT32 = 4
#: message kinds with their own column; any other kind a method declares (``extra_traffic_bytes``)
#: is summed into ``other_extra_per_round_mib`` and named in ``other_extra_kinds``
NAMED_KINDS = ("prototype", "style_statistics")


def optimisation_sizes(cfg: Config) -> dict[str, int]:
    targets = cfg.partition_targets()
    holdouts = client_holdouts(targets, cfg.manifest.holdout_fraction)
    return {client: sum(pool) - sum(holdouts[client]) for client, pool in targets.clients.items()}


def communication_table(cfg: Config, encoder: str | None = None) -> list[dict]:
    encoder = encoder or cfg.model.encoder.name
    targets = cfg.partition_targets()
    availability = {client: [n > 0 for n in pool] for client, pool in targets.clients.items()}
    n_clients = len(availability)
    methods = list(dict.fromkeys([*cfg.train.methods, *cfg.train.ablations]))
    rows = []
    baseline = None
    for method in ["fedavg_peft", *[m for m in methods if m != "fedavg_peft"]]:
        card = model_card(encoder, method, cfg.model)
        model = meta_model(encoder, method, cfg.model)
        state = model.trainable_state()
        payload = sum(t.numel() * t.element_size() for t in state.values())
        dim = model.classifier.in_features
        m = build_method(method, cfg)
        model_bytes = m.model_bytes(state, sorted(availability)) if m.exchanges_model else 0
        extra = m.extra_traffic_bytes(dim, availability, optimisation_sizes(cfg), payload)
        protos = prototype_traffic(dim, availability) if "prototype" in extra else None
        style = extra.get("style_statistics", 0)
        other = {k: v for k, v in extra.items() if k not in NAMED_KINDS}  # e.g. control variates
        per_round = model_bytes + sum(extra.values())
        if method == "fedavg_peft":
            baseline = per_round
        rows.append({
            "method": method,
            "encoder": encoder,
            "total_parameters": card["total_parameters"],
            "trainable_parameters": card["trainable_parameters"],
            "trainable_fraction_pct": f"{card['trainable_fraction_pct']:.6f}",
            "payload_mib": f"{payload / MIB:.6f}",
            "model_per_round_mib": f"{model_bytes / MIB:.6f}",
            "prototype_per_round_mib": f"{(protos.total_bytes if protos else 0) / MIB:.6f}",
            "style_statistics_per_round_mib": f"{style / MIB:.6f}",
            "other_extra_per_round_mib": f"{sum(other.values()) / MIB:.6f}",
            "other_extra_kinds": ";".join(sorted(other)),
            "per_round_mib": f"{per_round / MIB:.6f}",
            "overhead_vs_fedavg_pct": f"{100 * (per_round - baseline) / baseline:.6f}",
            "prototype_residual_vs_study_mib": f"{((protos.total_bytes - protos.study_bytes) if protos else 0) / MIB:.6f}",
            "descriptor_upload_once_mib": f"{n_clients * DESCRIPTOR_DIM * FLOAT32 / MIB:.6f}",
            "clients": n_clients,
        })
    include = set(methods)
    return [r for r in rows if r["method"] in include]


def run_accounting(cfg: Config, out_csv: str | Path) -> list[dict]:
    rows = communication_table(cfg)

    write_csv(out_csv, rows)
    write_sidecar(out_csv, provenance_block(STAGE, stage_block(cfg, STAGE)))
    return rows
