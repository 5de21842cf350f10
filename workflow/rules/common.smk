# Parse-time configuration checks: the JSON schema first (house style), then the typed
# per-stage models, whose errors name the dotted key and the allowed values.
import os

from snakemake.utils import validate

from fedhisto.bootstrap.stage import comparison_files
from fedhisto.config.study import STUDY_METHODS, command_line_config
from fedhisto.entry import study_config
from fedhisto.experiments.dose_response import entry_resources as dose_entry_resources
from fedhisto.experiments.layout import all_outputs as experiment_outputs
from fedhisto.methods import wildcard_pattern
from fedhisto.realdata.listing import sources_inventory
from fedhisto.registries.encoder_registry import encoder_entry
from fedhisto.config.stage_blocks import stage_block
from fedhisto.infra.processes import available_memory_mb
from fedhisto.infra.warm_server import start_server, stop_server as stop_warm_server


# A config file given on the command line (--configfile) is a whole study setup: the run's config is those
# files laid in order, then --config, over nothing else, not over the Snakefile's config/config.yaml.
# Snakemake would lay them over the embedded default, whose tiny-encoder blocks (model.pretrain, the tiny
# widths, lr 1e-3, its method list) then pass into config/paper.yaml's HIBOU-B run: a parse error at best,
# a silently different study at worst. Making only the tiny blocks conditional would still let every other
# default key (seeds, rounds, bootstrap resamples) leak; replacing the base leaves none. Keys a file leaves
# out take the typed models' defaults (the study's numbers). `fedhisto check-config FILE...` builds the
# config with the same function.
if workflow.config_settings.configfiles:
    _given = command_line_config(workflow.config_settings.configfiles, dict(workflow.config_settings.config))
    config.clear()
    config.update(_given)
    CONFIG_SOURCE = "config (" + " + ".join(map(str, workflow.config_settings.configfiles)) + ", then --config)"
else:
    CONFIG_SOURCE = "config (config/config.yaml, then --config overrides)"
validate(config, schema="../schemas/config.schema.json", set_default=False)
CFG = study_config(config, source=CONFIG_SOURCE)

# Every training job waits for two chains: cohort -> clearance -> manifest -> stain, and the tiny encoder's
# pretraining, which needs no cohort. CPU seconds on the embedded default (benchmarks/pipeline_timeline.py,
# docs/changelog.md): cohort ~37, clearance ~72, pretraining ~16, manifest + stain ~3. The cohort takes both
# cores, then clearance one and pretraining (then the accounting) the other. Clearance on two cores would
# start training ~20 s sooner on an idle host, but its two verification workers each run OpenCV's own thread
# pool: on a loaded host they spent several times the single process's CPU (1,016 s for a 41 s phase), so
# the embedded default keeps it on one.
CLEARANCE_THREADS = 1 if CFG.cohort.mode == "synthetic" else 2
# Priorities, highest first: the two chains above; then whatever follows training (predictions,
# comparisons, metrics, tables), as soon as its inputs exist, so that it runs between training jobs instead
# of after the last; then training, one method after the other (train_priority), so that methods finish,
# and their predictions and comparisons run, while later methods train.
CRITICAL_PATH_PRIORITY = 1000
PRETRAIN_PRIORITY = CRITICAL_PATH_PRIORITY - 1  # beside clearance, after the 2-thread cohort (equal, it could go first)
AFTER_TRAINING_PRIORITY = 500


def limit_local_memory(wf):
    """A local run schedules its jobs within the host's memory: unless the user gave --resources mem_mb=...,
    the host's available memory (MemAvailable at parse time) is the run's mem_mb budget, so that jobs whose
    declared mem_mb (the measured peak of the encoder in use) do not fit side by side wait instead of being
    killed by the kernel's out-of-memory killer (two HIBOU-B trainings on a 24 GiB machine). A job that
    declares more than the host has is held to the host's memory and runs alone. Cluster runs (the scheduler
    enforces each job's mem_mb) and dry runs are left as they are."""
    if wf.global_resources.get("mem_mb").value is not None:
        return None  # the user's own budget
    try:
        remote = wf.remote_exec or not wf.local_exec
    except Exception:  # Snakemake's API moved: treat it as local, the safer side
        remote = False
    host = available_memory_mb()
    if remote or host is None:
        return None
    wf.global_resources["mem_mb"] = host
    return host


HOST_MEM_MB = limit_local_memory(workflow)


# The scripts that hand their stage to the warm server (fedhisto.infra.warm_server.call): the torch stages, and the
# experiments' rules (scripts/experiments.py: all but two of them).
WARM_SCRIPTS = {"train.py", "predict.py", "pretrain.py", "stain.py", "accounting.py", "metrics.py", "report.py",
                "bootstrap.py", "experiments.py"}


def start_warm_server(wf):
    """Local runs only: cluster jobs run on other hosts under the scheduler's limits, jobs under a
    software deployment method (--sdm) under another interpreter; they all start cold, as does any job
    with FEDHISTO_WARM=0. A run with fewer than three torch jobs to do skips it: the server's own imports
    cost about what three cold jobs' do."""
    if not (wf.local_exec and not wf.remote_exec and not wf.deployment_settings.deployment_method):
        return
    try:
        torch_jobs = sum(1 for job in wf.dag.needrun_jobs()
                         if job.rule.script and os.path.basename(job.rule.script) in WARM_SCRIPTS)
    except Exception:  # Snakemake's DAG API moved: start it, as for any run
        torch_jobs = len(WARM_SCRIPTS)
    if torch_jobs >= 3:
        start_server("logs/warm_server.log")


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
    """(method, seed) of every configured run: principal methods x seeds, extra comparators x
    comparator seeds (train.seeds unless set), ablations x ablation seeds."""
    return CFG.train_runs()


def method_seeds(method):
    return CFG.trained_seeds(method)


def train_order():
    """Methods in the order they train: those in the most configured comparisons first (v2, on one side of
    every comparison: each later method's comparisons can then run as soon as its seeds are done), then the
    config's order; the study's methods and ablations before the extra comparators."""
    methods = [*CFG.train.methods, *CFG.train.ablations]
    comparisons = [CFG.bootstrap.comparisons[n] for n in comparisons_in_config()]
    weight = {m: sum(m in (c.method, c.reference) for c in comparisons) for m in methods}
    return sorted(methods, key=lambda m: (is_comparator(m), -weight[m], methods.index(m)))


def _train_priority(wildcards):
    """Below AFTER_TRAINING_PRIORITY; the earlier a method in train_order, the higher."""
    order = train_order()
    return len(order) - order.index(wildcards.method) if wildcards.method in order else 0


def _callable_priorities():
    import snakemake.rules

    return hasattr(snakemake.rules.Rule, "expand_priority")


# a Snakemake that takes no priority function (before 9.x's expand_priority) trains in its own order
TRAIN_PRIORITY = _train_priority if _callable_priorities() else 1


# `all` builds the study: its principal methods and ablations, the comparisons among them, Table 2 and
# Tables 4-8. The extra comparators (every other entry of train.methods: FedStain, SCAFFOLD, FedAdam, the LoRA
# aggregators, local_only, pooled, ...) are the target `comparators`: on the embedded default they are 39 of
# 73 training runs, which put `all` on 2 cores well past the first command's budget. Metrics, tables and
# figures show a comparator's rows whenever its runs are there: after `snakemake comparators` (which also
# brings the tables up to date) and in every later `all`.
def is_comparator(method):
    return method in CFG.train.methods and method not in STUDY_METHODS


def comparator_methods():
    return [m for m in CFG.train.methods if is_comparator(m)]


def comparators_requested():
    """The run was asked for the `comparators` target (its runs then enter metrics and tables before they exist)."""
    try:
        return "comparators" in workflow.dag_settings.targets
    except AttributeError:  # Snakemake's API moved: comparators enter the tables once trained
        return False


def comparator_trained(method):
    return all(os.path.exists(f"results/train/{method}/seed{s}/status.json") for s in method_seeds(method))


def reported_methods():
    """Methods whose runs metrics, tables and figures show: the study's, and each comparator asked for or trained."""
    requested = comparators_requested()
    return {m for m, _ in train_runs() if not is_comparator(m) or requested or comparator_trained(m)}


def reported_runs():
    methods = reported_methods()
    return [(m, s) for m, s in train_runs() if m in methods]


def reported_comparisons():
    methods = reported_methods()
    comparisons = CFG.bootstrap.comparisons
    return [n for n in comparisons_in_config() if {comparisons[n].method, comparisons[n].reference} <= methods]


def study_comparisons():
    comparisons = CFG.bootstrap.comparisons
    return [n for n in comparisons_in_config()
            if not (is_comparator(comparisons[n].method) or is_comparator(comparisons[n].reference))]


def comparator_targets():
    """The comparators' runs, their comparisons with the study's methods, and the tables that show them."""
    runs = [(m, s) for m, s in train_runs() if is_comparator(m)]
    return [f"results/train/{m}/seed{s}/status.json" for m, s in runs] + [
        f"results/bootstrap/{n}.json" for n in comparisons_in_config() if n not in study_comparisons()] + [
        "results/metrics/summary.csv", "results/metrics/robustness.csv", "results/tables/table4_internal.csv"]


def seed_groups():
    """[(seeds, methods)]: the configured methods grouped by the seed list they train on, that of
    train.seeds first. One prediction rule per group, since a rule's outputs are fixed patterns."""
    groups = {tuple(CFG.train.seeds): []}
    for m in [*CFG.train.methods, *CFG.train.ablations]:
        groups.setdefault(tuple(method_seeds(m)), []).append(m)
    return [(list(seeds), methods) for seeds, methods in groups.items() if methods]


def predict_rule_name(seeds):
    """`predict_cohorts` for the methods on train.seeds; `predict_cohorts_seeds_11_33_55` for others."""
    return "predict_cohorts" if list(seeds) == list(CFG.train.seeds) else "predict_cohorts_seeds_" + "_".join(
        map(str, seeds))


def encoder_input(wildcards):
    """The pipeline-pretrained tiny encoder, when the config asks for one."""
    return ["results/pretrain/encoder"] if CFG.model.pretrain.enabled else []


def comparison_inputs(name, role):
    """External predictions of the comparison's method or reference ensemble, both on the same seeds
    (an ablation comparison: train.ablation_seeds; any other: the seeds both methods train on)."""
    return comparison_files(CFG, name)[role][1]


def comparisons_in_config():
    """Comparisons whose two methods are both configured to train."""
    return CFG.trained_comparisons()


def all_targets():
    return cohort_outputs() + [f"results/train/{m}/seed{s}/status.json" for m, s in train_runs()
                               if not is_comparator(m)] + [
        "results/metrics/summary.csv",
        "results/tables/table4_internal.csv",
        *[f"results/bootstrap/{n}.json" for n in study_comparisons()],
        "results/clearance/report.md",
        "results/manifest/composition.csv",
        "results/stain/descriptors.json",
        "results/accounting/communication.csv",
        *[f"results/classify/{name}/predictions.csv" for name in CFG.classify.folders],
    ]


# Resource hints come from the encoder's registry entry (fedhisto.registries.encoder_registry, torch-free): a
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


def pretrain_inputs(wildcards):
    """The manifest, only when the tiny encoder is pretrained on the clients' optimisation images."""
    ssl = CFG.model.pretrain.objective == "self_supervised"
    return {"manifest": "results/manifest/manifest.csv"} if ssl else {}


def encoder_gpu(encoder, wildcards):
    """A dose-response encoder entry asks for its own device; the built-in conditions, the main encoder's."""
    if CFG.experiments.dose_response.entry(encoder):
        return dose_entry_resources(CFG, encoder)["gpu"]
    return train_gpu(wildcards)


def predict_method_runtime(wildcards):
    """One job predicts every seed of a method."""
    return predict_runtime(wildcards) * len(method_seeds(wildcards.method))


# ---------------------------------------------------------------- classify (workflow/rules/classify.smk)
def classify_images(wildcards):
    return CFG.classify.folders[wildcards.name]


def classify_cohort_input(wildcards):
    """A folder of the pipeline's own cohort is made by the cohort stage; a site's folder is the user's."""
    folder = classify_images(wildcards)
    return cohort_outputs()[:1] if folder.startswith("results/cohort/") else []


# ------------------------------------------------------------- experiments (workflow/rules/experiments.smk)
# An experiment step's (fedhisto.experiments.framework.Step) inputs, outputs and resources as its rule takes them.
STEP_RESOURCES = {
    "train": {"mem_mb": train_mem_mb, "runtime": train_runtime, "gpu": train_gpu},
    "predict": {"mem_mb": predict_mem_mb, "runtime": predict_runtime, "gpu": train_gpu},
    "predict_encoder": {"mem_mb": predict_mem_mb, "runtime": predict_runtime,
                        "gpu": lambda wildcards: encoder_gpu(wildcards.encoder, wildcards)},
}


def step_inputs(step):
    return step.inputs if callable(step.inputs) else lambda wildcards: step.inputs


def step_resource(step, key):
    if isinstance(step.resources, str):
        return STEP_RESOURCES[step.resources][key]
    if callable(step.resources):
        return lambda wildcards: step.resources(wildcards)[key]
    return step.resources[key]


def step_outputs(step):
    return {k: directory(v) if k in step.directories else v for k, v in step.output.items()}
