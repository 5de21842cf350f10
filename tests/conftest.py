from __future__ import annotations

import csv
import logging
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n auto` every worker is its own torch process: torch's default of one OpenMP
    # thread per core would put workers x cores threads on the cores, and they spin against each
    # other (measured on 2 cores: 947 s of user CPU for the 587 s the suite takes in one process).
    # One thread per worker, inherited by the Snakemake runs and stage processes the tests start
    # (stages still set their own count from `threads:`).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

# An OpenMP thread that waits for work spins by default (libgomp's active wait): with the suite's processes,
# its Snakemake jobs (which take threads from `threads:`) and CI's other lanes on 2 cores, a 2-thread torch
# process spun while its partner thread waited for a core. Eight bf16 rounds of tests/test_gpu_path.py at
# torch.set_num_threads(2) took 206 s of CPU with the default wait and 16 s with the passive one (the same
# as at one thread; load 15-20). The wait policy changes no result, only how idle threads wait. Inherited
# by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Every Flower process the tests start (up to eight sites, their SuperExecs, the SuperLink) runs on the
# same cores as the training it waits for. The deployment's default polls (SuperNode 0.2 s, SuperExec
# 0.1 s) are a latency lever for sites on their own machines; on one 2-core host their idle requests
# took the CPU the rounds needed: the site-local deployment test took 174 s of CPU and 128 s alone at
# those polls, 111 s and 88 s at 1 s. Flower's own variable and ours, read by those processes only.
os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "1.0")
os.environ.setdefault("FEDHISTO_SUPERNODE_POLL_S", "1.0")


# The markers of the proofs that run in lanes of their own (`pytest -m flower` and so on, .ci/run).
LANE_MARKERS = ("slurm", "flower", "zoo", "study")


def pytest_ignore_collect(collection_path: Path, config):
    """Under ``-m <lane marker>`` alone, skip the test files that never name the marker: importing all of
    them (torch, transformers, every stage) cost each lane about 14 s of CPU to deselect all but a few
    tests. A marker is only ever applied by name in the file (tests/test_test_harness.py checks that no
    test adds one another way)."""
    expr = (config.getoption("markexpr") or "").strip()
    if (expr in LANE_MARKERS and collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and f"mark.{expr}" not in collection_path.read_text()):
        return True
    return None


@pytest.fixture(autouse=True)
def _stage_logging_stays_in_its_test():
    """A test that runs a stage in-process gets ``entry.setup_logging``'s root handlers on the stderr
    pytest captured for it; left in place, a later test's log lines go to that closed stream and
    "--- Logging error ---" lands on the later test's stderr (seen under ``-n auto``, where a worker's
    test order differs). Remove the plain stream and file handlers a test added, and its excepthook."""
    root = logging.getLogger()
    before, hook = list(root.handlers), sys.excepthook
    yield
    for handler in list(root.handlers):
        if type(handler) in (logging.StreamHandler, logging.FileHandler) and handler not in before:
            root.removeHandler(handler)
            handler.close()
    sys.excepthook = hook


@pytest.fixture(autouse=True)
def _torch_threads_stay_in_their_test():
    """A test that runs a stage or command in-process (``fedhisto classify`` defaults to --threads 2, a
    stage's run_* takes ``threads``) calls ``torch.set_num_threads``, which outlives the test: every later
    torch test of that process ran 2+ OpenMP threads spinning against the other worker's and the other CI
    lanes' (tests/test_test_harness.py). Put back the count the process started with. torch is looked at
    only once a test has imported it."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if before is None:  # imported by this test: the count torch started with, from the environment
        before = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else None
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


def write_image(path: Path, seed: int = 0, size: int = 24, fmt: str | None = None, mode: str = "RGB") -> Path:
    """A small random image file (fixture folders stand in for real datasets)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path, format=fmt)
    return path


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def snakemake_bin() -> str:
    exe = shutil.which("snakemake")
    if exe is None:
        pytest.fail("snakemake not on PATH: install the package with its dependencies")
    return exe


def write_tiny_config(workdir: Path, max_rounds: int = 2) -> Path:
    """The embedded default shrunk for workflow tests: three methods (one keeping a model per client), one
    seed, few rounds, a 1-epoch pretrain."""
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["cohort"]["synthetic"]["profile"] = "small"  # the default's pools, evaluation sets of 36 and 64 images
    cfg["train"].update(methods=["fedavg_peft", "past_v2", "local_only"], seeds=[11], ablations=[],
                        comparator_seeds=None, max_rounds=max_rounds)
    cfg["model"]["pretrain"].update(images_per_class=12, epochs=1)
    # every experiment at its smallest: two methods, one seed, one left-out site, two severities
    cfg["experiments"].update(methods=["fedavg_peft", "past_v2"], seeds=[11], resamples=200)
    # no stain-augmented arm: its stain-invariant condition is a main run the tiny config does not train
    # (tests/test_dose_response_arms.py covers the arm)
    cfg["experiments"]["dose_response"].update(severities=[0.0, 1.0], images_per_class=5, extra_methods=[])
    cfg["experiments"]["leakage"].update(policies=["ignore_families", "representatives"], methods=["fedavg_peft"])
    cfg["experiments"]["leave_one_site_out"].update(left_out=["C1"], extra_methods=[])
    cfg["experiments"]["sensitivity"] = {"conclusions": [["past_v2", "fedavg_peft"]], "seeds": [11], "severity": 1.0,
                                         "readings": {"ce_views_sum": {"train.readings.ce_views": "sum"}}}
    cfg["experiments"]["privacy_audit"].update(methods=["fedavg_peft"], noise_multipliers=[1.0], rounds=1,
                                               canaries_per_side=3)
    path = workdir / "config/config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


# A rendered cohort (the "tiny" profile: half the embedded default), manifest and descriptors shared by the
# training tests (tiny, random encoder).
TINY = {"cohort": {"synthetic": {"profile": "tiny"}},
        "model": {"encoder": {"name": "tiny", "require_pretrained": False}, "adapter_hidden": 16, "film_hidden": 16},
        "views": {"crop_size": 48}, "train": {"max_rounds": 4, "patience": 10, "lr": 1e-3}}


def prepare_cohort(root: Path, tiny: dict) -> dict:
    """A rendered cohort (``tiny``'s profile), a manifest of its originals (every image its own family) and stain
    descriptors, under ``root``, with ``tiny`` as the config."""
    from fedhisto.clearance.stage import FAMILY_COLUMNS
    from fedhisto.cohort.stage import run_cohort
    from fedhisto.config.study import PlantedFamilies, load_config
    from fedhisto.manifest.stage import run_manifest
    from fedhisto.realdata.sources import read_sources_csv
    from fedhisto.stain.stage import run_stain

    cfg = load_config(tiny)
    synthetic = cfg.cohort.synthetic.model_copy(update={"planted": PlantedFamilies(families_per_site=0)})
    cohort = cfg.cohort.model_copy(update={"synthetic": synthetic})
    run_cohort(cohort, root / "cohort", threads=2)
    rows = read_sources_csv(root / "cohort/sources.csv")
    with (root / "families.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FAMILY_COLUMNS)
        w.writeheader()
        for k, r in enumerate(rows):  # no planted copies: every image is its own family
            w.writerow({"relpath": r.relpath, "path": r.path, "label": r.label, "site": r.site, "cohort": r.cohort,
                        "sha256": f"s{k}", "family": f"f{k}", "family_size": 1, "representative": True, "keep": True})
    (root / "edges.csv").write_text("a,b,stage,score,threshold,decision\n")
    run_manifest(root / "cohort/sources.csv", root / "families.csv", root / "edges.csv", cfg, root / "manifest")
    run_stain(root / "manifest/manifest.csv", cfg, root / "stain")
    (root / "config.yaml").write_text(yaml.safe_dump(tiny))
    return {"root": root, "cfg": cfg, "config": root / "config.yaml", "manifest": root / "manifest/manifest.csv",
            "identity": root / "manifest/manifest.json", "descriptors": root / "stain/descriptors.json",
            "images": root / "cohort"}


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> dict:
    return prepare_cohort(tmp_path_factory.mktemp("train"), TINY)


def train(prepared: dict, method: str, out: Path, cfg=None, **hooks) -> dict:
    from fedhisto.train.stage import run_train

    return run_train(method, 11, prepared["manifest"], prepared["identity"], prepared["descriptors"],
                     cfg or prepared["cfg"], out, **hooks)




#: The one lint the workflows answer by design: their jobs run in the environment the package is installed
#: in (docs/cluster.md), so no rule names a conda env or container.
SOFTWARE_LINT = "Specify a conda environment or container for each rule."


def assert_lint_clean(proc) -> None:
    """``snakemake --lint`` found nothing, or only the software-environment advice, once per rule."""
    import re

    out = proc.stdout + proc.stderr
    if "Congratulations" in out:
        assert proc.returncode == 0, out
        return
    titles = set(re.findall(r"^    \* (.+):$", out, flags=re.M))
    rules_linted = re.findall(r"^Lints for rule (\w+)", out, flags=re.M)
    assert rules_linted and titles == {SOFTWARE_LINT}, out[-4000:]
    assert len(rules_linted) == out.count(SOFTWARE_LINT), "a rule has a lint beside the software one: " + out[-4000:]
