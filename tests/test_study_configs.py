"""Every shipped config through Snakemake itself: a config file on the command line is a whole study setup
(not laid over config/config.yaml), `fedhisto check-config` sees what Snakemake sees, and a local run
budgets its jobs' memory from the host."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from study_layouts import build_study_folders, sources_overlay

from fedhisto.config.study import STUDY_METHODS, command_line_config, layer, load_config, load_config_file

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.name for p in (REPO / "config").glob("*.yaml"))


def _snakemake(snakemake_bin: str, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """From the repository root (relative --configfile paths are the user's), working in ``workdir``."""
    return subprocess.run([snakemake_bin, "-s", str(REPO / "Snakefile"), "-d", str(workdir), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # a hang guard, not a speed check


def _study_runs(cfg) -> list[tuple[str, int]]:
    """The runs `all` trains: the study's principal methods and the ablations (the extra comparators are the
    target `comparators`)."""
    return [(m, s) for m, s in cfg.train_runs() if m in STUDY_METHODS or m in cfg.train.ablations]


def _job_counts(text: str) -> dict[str, int]:
    """Snakemake's dry-run job table: rule -> count."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", text, flags=re.M)}


@pytest.fixture(scope="module")
def roots_overlay(tmp_path_factory) -> Path:
    """config/paper.yaml's sources pointed at test-made folders in the three real layouts."""
    base = tmp_path_factory.mktemp("study_data")
    folders = build_study_folders(base, lc25000_per_class=2, wsss4luad_tiles={"ACA": 2, "Normal": 2, "stroma": 1},
                                  lunghist700_per_class=2)
    path = base / "roots.yaml"
    path.write_text(yaml.safe_dump({"cohort": {"real": {"sources": sources_overlay(folders)}}}))
    return path


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_dry_runs_through_snakemake_and_plans_its_whole_study(
        name: str, roots_overlay: Path, snakemake_bin: str, tmp_path: Path):
    files = [str(REPO / "config" / name)] + ([str(roots_overlay)] if name == "paper.yaml" else [])
    proc = _snakemake(snakemake_bin, tmp_path, "-n", "all", "--configfile", *files)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    cfg = load_config_file(*files)
    jobs = _job_counts(text)
    # `all`: every (method, seed) of the study's five methods and the ablations trains, and every comparison
    # among them is bootstrapped; `all comparators`: every configured run and comparison
    study = _study_runs(cfg)
    study_methods = {m for m, _ in study}
    within = [n for n in cfg.trained_comparisons()
              if {cfg.bootstrap.comparisons[n].method, cfg.bootstrap.comparisons[n].reference} <= study_methods]
    assert jobs["train_federated"] == len(study)
    assert jobs["bootstrap_comparison"] == len(within)
    assert jobs["make_report"] == 1 and jobs["summarize_metrics"] == 1
    proc = _snakemake(snakemake_bin, tmp_path, "-n", "all", "comparators", "--configfile", *files)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    everything = _job_counts(proc.stdout + proc.stderr)
    assert everything["train_federated"] == len(cfg.train_runs())
    assert everything["bootstrap_comparison"] == len(cfg.trained_comparisons())
    if name == "paper.yaml":
        assert len(study) == 5 * 5 + 3 * 3 and len(cfg.train_runs()) == 9 * 5 + 3 * 3
        assert len(cfg.trained_comparisons()) == 11
        assert cfg.model.encoder.name == "hibou-b" and "pretrain_encoder" not in jobs
        assert jobs["collect_sources"] == 1


def test_paper_config_alone_parses_in_snakemake_and_check_config_says_so(snakemake_bin: str, tmp_path: Path):
    """The command config/paper.yaml's header gives: the default's tiny-encoder blocks do not leak in."""
    proc = _snakemake(snakemake_bin, tmp_path, "-n", "--configfile", str(REPO / "config/paper.yaml"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = subprocess.run([sys.executable, "-m", "fedhisto.cli", "check-config", "config/paper.yaml"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "config/paper.yaml: valid (cohort mode real, encoder hibou-b;" in out.stdout


def test_check_config_and_snakemake_reject_the_same_merged_config(snakemake_bin: str, tmp_path: Path):
    """Two files laid in order: the embedded default plus an overlay that switches to HIBOU-B keeps the
    default's tiny pretraining block, which is an error for both, with the same key and message."""
    overlay = tmp_path / "hibou.yaml"
    overlay.write_text("model:\n  encoder:\n    name: hibou-b\n")
    message = "model.pretrain.enabled only applies to the tiny encoder"
    proc = _snakemake(snakemake_bin, tmp_path, "-n", "--configfile", str(REPO / "config/config.yaml"), str(overlay))
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()
    out = subprocess.run([sys.executable, "-m", "fedhisto.cli", "check-config", "config/config.yaml", str(overlay)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and message in out.stdout + out.stderr
    # the overlay alone is a whole setup: HIBOU-B with the study's defaults, valid for both
    out = subprocess.run([sys.executable, "-m", "fedhisto.cli", "check-config", str(overlay), "--config",
                          "cohort={synthetic: {profile: tiny}}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    tiny = {"cohort": {"synthetic": {"profile": "tiny"}}}
    assert load_config(command_line_config([overlay], tiny)).cohort.synthetic.profile == "tiny"
    # --config values are read as Snakemake reads them (nested values stay strings): the same error either way
    out = subprocess.run([sys.executable, "-m", "fedhisto.cli", "check-config", str(overlay), "--config",
                          "bootstrap={resamples: 500}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "key 'bootstrap.resamples': '500' is not of type 'integer'" in out.stdout + out.stderr
    proc = _snakemake(snakemake_bin, tmp_path, "-n", "--configfile", str(overlay), "--config", "bootstrap={resamples: 500}")
    assert proc.returncode != 0 and "'500' is not of type 'integer'" in proc.stdout + proc.stderr


def test_without_a_configfile_config_overrides_still_lay_over_the_embedded_default(snakemake_bin: str,
                                                                                     tmp_path: Path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())  # the workdir's default
    # the target first: --quiet takes "all" as one of its own values
    proc = _snakemake(snakemake_bin, tmp_path, "-n", "all", "--quiet", "rules", "--config",
                      "cohort={synthetic: {profile: tiny}}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    default = load_config_file(REPO / "config/config.yaml")
    assert _job_counts(text)["train_federated"] == len(_study_runs(default))
    assert "pretrain_encoder" in text  # the default's own tiny-encoder pretraining is still there


def test_layer_merges_as_snakemake_lays_config_files():
    from snakemake.utils import update_config

    base = {"a": {"b": 1, "c": [1, 2], "d": {"e": 1}}, "f": 1}
    over = {"a": {"c": [3], "d": {"g": 2}}, "f": {"h": 1}, "i": None}
    expected = yaml.safe_load(yaml.safe_dump(base))
    update_config(expected, over)
    assert layer(base, over) == expected == {"a": {"b": 1, "c": [3], "d": {"e": 1, "g": 2}}, "f": {"h": 1}, "i": None}
    assert base["a"]["d"] == {"e": 1}  # neither argument changes


def test_available_memory_is_read_from_meminfo(tmp_path: Path):
    from fedhisto.infra.processes import available_memory_mb

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684544 kB\nMemFree:         1000000 kB\nMemAvailable:   20480000 kB\n")
    assert available_memory_mb(meminfo) == 20000
    meminfo.write_text("MemTotal:       24684544 kB\n")
    assert available_memory_mb(meminfo) is None
    assert available_memory_mb(tmp_path / "absent") is None


def _train_mem_mb(text: str) -> set[int]:
    blocks = re.findall(r"rule train_federated:.*?resources: ([^\n]*)", text, flags=re.S)
    return {int(re.search(r"mem_mb=(\d+)", b).group(1)) for b in blocks}


def test_a_local_run_holds_each_job_to_the_hosts_memory_unless_the_user_sets_mem_mb(
        roots_overlay: Path, snakemake_bin: str, tmp_path: Path):
    """HIBOU-B's training declares 24000 MB: on a host with less, each job is held to the host's available
    memory, so two never run side by side; --resources mem_mb=... is the user's own budget."""
    from fedhisto.registries.encoder_registry import encoder_entry

    total_mb = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                        if line.startswith("MemTotal")).split()[1]) // 1024
    declared = encoder_entry("hibou-b").resources.train_mem_mb
    args = ("-n", "--configfile", str(REPO / "config/paper.yaml"), str(roots_overlay))
    proc = _snakemake(snakemake_bin, tmp_path, *args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (mem,) = _train_mem_mb(proc.stdout + proc.stderr)
    assert mem <= min(declared, total_mb)
    proc = _snakemake(snakemake_bin, tmp_path, *args, "--resources", "mem_mb=5000")
    assert _train_mem_mb(proc.stdout + proc.stderr) == {5000}


@pytest.mark.parametrize("where", ["docs/cluster.md", "config/paper.yaml"])
def test_the_documented_study_commands_plan_the_study(where: str, roots_overlay: Path, snakemake_bin: str,
                                                      tmp_path: Path):
    """The one-GPU command (docs/cluster.md) and config/paper.yaml's own header command, as written, with
    -n and the test-made roots laid last. (`all` stands before --configfile, which takes every name after it.)"""
    text = (REPO / where).read_text()
    command = {"docs/cluster.md": "snakemake --cores 8 all --resources gpu=1 --configfile config/paper.yaml",
               "config/paper.yaml": "snakemake --cores 8 all --configfile config/paper.yaml"}[where]
    assert (f"```bash\n{command}\n```" if where.endswith(".md") else f"# Run with: {command}\n") in text
    proc = _snakemake(snakemake_bin, tmp_path, "-n", *command.split()[1:], str(roots_overlay))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert _job_counts(proc.stdout + proc.stderr)["train_federated"] == 5 * 5 + 3 * 3  # the study; comparators apart


def test_an_encoder_folder_of_another_architecture_under_paper_config_is_an_error_naming_it(tmp_path: Path):
    """A ViT snapshot (Phikon's architecture, model_type 'vit') where config/paper.yaml expects HIBOU-B."""
    import transformers

    from fedhisto.model.encoder import EncoderLoadError, load_encoder

    folder = tmp_path / "not-hibou"
    folder.mkdir()
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(folder)
    cfg = load_config_file(REPO / "config/paper.yaml").model.encoder.model_copy(update={"local_dir": str(folder)})
    with pytest.raises(EncoderLoadError, match=re.escape(str(folder)) + r".*model_type 'vit' is not hibou-b's"):
        load_encoder(cfg)
