# Parse-time configuration checks: the JSON schema first (house style), then the typed
# per-stage models, whose errors name the dotted key and the allowed values.
from snakemake.utils import validate

from fedhisto.bootstrap import comparison_files
from fedhisto.config import load_config
from fedhisto.experiments.layout import all_outputs as experiment_outputs
from fedhisto.methods import wildcard_pattern
from fedhisto.zoo import encoder_entry
from fedhisto.stage_config import stage_block


validate(config, schema="../schemas/config.schema.json", set_default=False)
CFG = load_config(config, source="config (after --configfile/--config overrides)")

ENV = "../../envs/fedhisto.yaml"


wildcard_constraints:
    method=wildcard_pattern(),
    seed=r"\d+",


def cohort_outputs():
    common = ["results/cohort/sources.csv", "results/cohort/contact_sheet.png", "results/cohort/summary.json"]
    if CFG.cohort.mode == "synthetic":
        return common + ["results/cohort/planted_families.csv"]
    return common + ["results/cohort/excluded.csv"]


def planted_input(wildcards):
    """Ground truth of the planted duplicates, scored by clearance on the synthetic cohort."""
    return ["results/cohort/planted_families.csv"] if CFG.cohort.mode == "synthetic" else []


def train_runs():
    """(method, seed) of every configured run: principal methods x seeds, ablations x ablation seeds."""
    runs = [(m, s) for m in CFG.train.methods for s in CFG.train.seeds]
    return runs + [(m, s) for m in CFG.train.ablations for s in CFG.train.ablation_seeds]


def encoder_input(wildcards):
    """The pipeline-pretrained tiny encoder, when the config asks for one."""
    return ["results/pretrain/encoder"] if CFG.model.pretrain.enabled else []


def comparison_inputs(name, role):
    """External predictions of the seeds of the comparison's method or reference ensemble (an
    ablation comparison: both on train.ablation_seeds, the study's matched seeds)."""
    return comparison_files(CFG, name)[role][1]


def comparisons_in_config():
    """Comparisons whose two methods are both configured to train."""
    return CFG.trained_comparisons()


def all_targets():
    return cohort_outputs() + [f"results/train/{m}/seed{s}/status.json" for m, s in train_runs()] + [
        "results/metrics/summary.csv",
        "results/tables/table4_internal.csv",
        *[f"results/bootstrap/{n}.json" for n in comparisons_in_config()],
        "results/clearance/report.md",
        "results/manifest/composition.csv",
        "results/stain/descriptors.json",
        "results/accounting/communication.csv",
    ]


# Resource hints come from the encoder's registry entry (fedhisto.zoo, torch-free): a
# foundation model asks for a GPU and hours, the tiny encoder runs on CPU in minutes.
ENCODER_RESOURCES = encoder_entry(CFG.model.encoder.name).resources


def train_mem_mb(wildcards):
    return ENCODER_RESOURCES.train_mem_mb


def train_runtime(wildcards):
    return ENCODER_RESOURCES.train_runtime


def train_gpu(wildcards):
    """Training and inference of a foundation model ask for a GPU; the tiny encoder runs on CPU."""
    return ENCODER_RESOURCES.gpu


def predict_mem_mb(wildcards):
    return ENCODER_RESOURCES.predict_mem_mb


def predict_runtime(wildcards):
    return ENCODER_RESOURCES.predict_runtime
