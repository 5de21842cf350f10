"""Site robustness (``results/metrics/robustness.csv``): the numbers are croma's, called here directly on the
same embeddings (read back with safetensors, not our reader), with the manifest frame and the APD schedule
written afresh in the test; the frozen encoder's embeddings are the plain encoder's; the report draws them; and the methods guide's reading
is the renderer's output on the committed rows."""

from __future__ import annotations

import copy
import csv
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY
from safetensors import safe_open
from safetensors.numpy import load_file

from fedhisto import CLASSES

REPO = Path(__file__).resolve().parents[1]
SEEDS = {"fedavg_peft": [11], "past_v2": [11, 22]}


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory) -> dict:
    """One-round tiny runs of FedAvg-PEFT and v2 (two seeds), predicted: the predict stage's own files."""
    from fedhisto.config.study import load_config
    from fedhisto.predict.stage import run_predict_seeds
    from fedhisto.train.stage import run_train

    root = tmp_path_factory.mktemp("robustness")
    tiny = copy.deepcopy(TINY)
    tiny["train"].update(seeds=[11, 22], ablation_seeds=[11, 22], max_rounds=1)
    cfg = load_config(tiny)
    inputs = (prepared["manifest"], prepared["identity"], prepared["descriptors"])
    out = []
    for method, seeds in SEEDS.items():
        for s in seeds:
            run_train(method, s, *inputs, cfg, root / f"train/{method}/seed{s}")
        run_predict_seeds(method, [(s, root / f"train/{method}/seed{s}", root / f"pred/{method}/seed{s}")
                                   for s in seeds], *inputs, cfg)
        out += [(method, s, root / f"pred/{method}/seed{s}") for s in seeds]
    return {"root": root, "cfg": cfg, "runs": out}


def croma_frame(manifest_csv: Path, ids: list[str]) -> pd.DataFrame:
    man = pd.read_csv(manifest_csv, dtype=str).set_index("sample_id").loc[ids].reset_index()
    return pd.DataFrame({"sample_id": man["sample_id"], "image_path": man["relpath"], "label": man["label"],
                         "group_id": man["family"], "site": man["site"]})


def croma_ri(features: np.ndarray, frame: pd.DataFrame, resamples: int, seed: int, level: float) -> dict:
    from croma import RI
    from croma.metrics.bootstrap import bootstrap_pooled_median

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = RI.compute(features, frame, confounder_column="site", k_candidates=[k for k in (5, 11, 21)
                                                                                  if k < len(frame)])
    ci = bootstrap_pooled_median(res.sample_values_aligned, frame["group_id"].to_numpy(), n_boot=resamples,
                                 level=level, seed=seed)
    return {"k": res.k, "support": res.support, "ri": res.value, "ri_median": res.median_value,
            "ri_median_ci_low": ci.lo, "ri_median_ci_high": ci.hi}


def test_every_run_and_the_frozen_encoder_have_crommas_ri(runs, prepared):
    from fedhisto.metrics.robustness import run_robustness

    out = runs["root"] / "metrics"
    doc = run_robustness(runs["runs"], prepared["manifest"], runs["cfg"], out)
    with (out / "robustness.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["method"], r["seed"], r["encoder_state"]) for r in rows] == [
        ("frozen_encoder", "", "frozen"), ("fedavg_peft", "11", "adapted"), ("past_v2", "11", "adapted"),
        ("past_v2", "22", "adapted")]
    b = runs["cfg"].bootstrap
    for r in rows:  # the interval: croma's cluster bootstrap with RESAMPLES (500) resamples, the config's seed
        method, seed = (r["method"], r["seed"]) if r["method"] != "frozen_encoder" else ("fedavg_peft", "11")
        path = str(runs["root"] / f"pred/{method}/seed{seed}/embeddings.safetensors")
        tensors = load_file(path)
        with safe_open(path, "np") as f:
            ids = json.loads(f.metadata()["sample_ids"])
        feats = tensors["frozen" if r["encoder_state"] == "frozen" else "adapted/global"].astype(np.float64)
        want = croma_ri(feats, croma_frame(prepared["manifest"], ids), 500, b.seed, b.confidence)
        assert int(r["k"]) == want["k"] and int(r["n_images"]) == len(ids) == 18
        for key in ("support", "ri", "ri_median", "ri_median_ci_low", "ri_median_ci_high"):
            assert float(r[key]) == pytest.approx(want[key], abs=5e-7), key  # the CSV rounds to 6 decimals
        # 18 test images: no site holds 2 x 3 images of each class, so APD is not measured, and says why
        assert r["apd"] == "" and "APD needs" in r["apd_note"]
    assert [s["method"] for s in doc["summary"]] == ["frozen_encoder", "fedavg_peft", "past_v2"]
    v2 = [float(r["ri"]) for r in rows if r["method"] == "past_v2"]
    assert doc["summary"][2]["ri_mean"] == pytest.approx(np.mean(v2), abs=1e-6)
    assert doc["summary"][2]["ri_sd"] == pytest.approx(np.std(v2, ddof=1), abs=1e-6)
    assert doc["comparisons"][0]["ri"]["seeds"] == [11] and doc["comparisons"][0]["method"] == "past_v2"
    assert (out / "robustness.csv.prov.json").exists()


def test_the_frozen_embeddings_are_the_plain_encoder_and_refused_when_runs_disagree(runs, prepared, tmp_path):
    from fedhisto.data.splits import eval_batches, load_partitions
    from fedhisto.metrics.robustness import RobustnessError, robustness_rows
    from fedhisto.model.encoder import load_encoder, pooled_embedding

    cfg = runs["cfg"]
    torch.manual_seed(0)  # the random tiny encoder every run of this config built (build_model)
    encoder = load_encoder(cfg.model.encoder, None)
    test = load_partitions(prepared["manifest"], cfg.views.crop_size, splits=("test",))["test"]
    with torch.no_grad():
        plain = torch.cat([pooled_embedding(encoder.entry, encoder.module, x)
                           for x, _ in eval_batches(test, cfg.views, 32)]).numpy()
    for method, seed, folder in runs["runs"]:
        stored = load_file(str(folder / "embeddings.safetensors"))
        assert np.allclose(stored["frozen"], plain, atol=1e-5), (method, seed)
        assert not np.allclose(stored["frozen"], stored["adapted/global"], atol=1e-2)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "test.csv").write_bytes((runs["runs"][1][2] / "test.csv").read_bytes())
    tensors = load_file(str(runs["runs"][1][2] / "embeddings.safetensors"))
    from fedhisto.stats.embedding_files import write_embeddings

    write_embeddings(bad / "embeddings.safetensors", test.ids, "test", {"global": tensors["adapted/global"]},
                     tensors["frozen"] + 0.1)
    with pytest.raises(RobustnessError, match="frozen-encoder embeddings differ"):
        robustness_rows([runs["runs"][0], ("past_v2", 33, bad)], prepared["manifest"], 100, 1, 0.95)


def synthetic_run(tmp_path: Path, per_cell: int = 24, shift: float = 0.5) -> tuple[Path, Path, np.ndarray, list]:
    """A predictions folder and manifest of four sites x three classes (site4 without SCC), embeddings with
    a class signal and a site offset: large enough for APD."""
    rng = np.random.default_rng(3)
    sites = ["site1", "site2", "site3", "site4"]
    rows, feats = [], []
    centres, offsets = rng.normal(size=(3, 16)), rng.normal(size=(4, 16)) * shift
    for i, site in enumerate(sites):
        for j, cls in enumerate(CLASSES):
            n = per_cell + 4 * i if not (site == "site4" and cls == "SCC") else 0
            for _ in range(n):
                sid = f"s{len(rows):04d}"
                rows.append({"sample_id": sid, "relpath": f"{site}/{sid}.png", "path": "", "label": cls, "site": site,
                             "family": f"f{sid}", "split": "test", "client": ""})
                feats.append(centres[j] + offsets[i] + rng.normal(size=16))
    manifest = tmp_path / "manifest.csv"
    pd.DataFrame(rows).to_csv(manifest, index=False)
    folder = tmp_path / "pred"
    folder.mkdir()
    (folder / "test.csv").write_text("sample_id,run_status\ns0000,finalised\n")
    from fedhisto.stats.embedding_files import write_embeddings

    feats = np.array(feats, dtype=np.float32)
    write_embeddings(folder / "embeddings.safetensors", [r["sample_id"] for r in rows], "test", {"global": feats},
                     feats + rng.normal(size=feats.shape).astype(np.float32))
    return manifest, folder, feats.astype(np.float64), rows


def test_apd_is_crommas_probe_sweep_on_the_stated_schedule(tmp_path):
    from croma import apd, probe_sweep

    from fedhisto.metrics.robustness import robustness_rows

    manifest, folder, feats, rows = synthetic_run(tmp_path)
    got, skipped = robustness_rows([("m", 11, folder)], manifest, 200, 7, 0.95, threads=2)
    assert skipped == [] and [r["encoder_state"] for r in got] == ["frozen", "adapted"]
    adapted = got[1]
    # the three sites with every class and the most images: site2, site3 (more per cell) and site1 (site4 has no
    # SCC); smallest cell 24 -> b = 24 // 6 = 4: balanced 4 per cell, half 8/2, total 12/0, all written out here
    assert adapted["apd_sites"] == "site1 site2 site3"
    # two replicates (APD_ITERATIONS), validation a quarter of each cell's training rows
    schedule = [([(i, j, 4) for i in range(3) for j in range(3)], 12),
                ([(i, j, 8 if i == j else 2) for i in range(3) for j in range(3)], 12),
                ([(i, j, 12 if i == j else 0) for i in range(3) for j in range(3)], 12)]
    keep = [k for k, r in enumerate(rows) if r["site"] in ("site1", "site2", "site3")]
    site = np.array([int(rows[k]["site"][-1]) - 1 for k in keep])
    label = np.array([CLASSES.index(rows[k]["label"]) for k in keep])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = probe_sweep(feats[keep], site, label, schedule=schedule, iterations=2, seed=1000,
                          validation_fraction=0.25)
    assert adapted["apd"] == pytest.approx(apd(acc), abs=1e-12)
    per = [apd(acc[:, [r]]) for r in range(2)]
    assert (adapted["apd_replicate_min"], adapted["apd_replicate_max"]) == pytest.approx((min(per), max(per)))
    frame = pd.DataFrame({"sample_id": [r["sample_id"] for r in rows], "image_path": [r["relpath"] for r in rows],
                          "label": [r["label"] for r in rows], "group_id": [r["family"] for r in rows],
                          "site": [r["site"] for r in rows]})
    want = croma_ri(feats, frame, 200, 7, 0.95)
    assert adapted["k"] == want["k"] and adapted["ri"] == pytest.approx(want["ri"], abs=1e-12)
    # a representation that carries the site more strongly is less robust by both measures
    strong = tmp_path / "strong"
    strong.mkdir()
    manifest2, folder2, _, _ = synthetic_run(strong, shift=1.5)
    got2, _ = robustness_rows([("m", 11, folder2)], manifest2, 200, 7, 0.95)
    assert got2[1]["ri"] < adapted["ri"] and got2[1]["apd"] < adapted["apd"]


def test_the_report_draws_the_table_and_figure(tmp_path):
    from fedhisto.metrics.robustness import COLUMNS, robustness_rows, summarize
    from fedhisto.report.stage import write_robustness

    manifest, folder, _, _ = synthetic_run(tmp_path)
    got, _ = robustness_rows([("fedavg_peft", 11, folder), ("past_v2", 11, folder)], manifest, 100, 7, 0.95)
    path = tmp_path / "robustness.csv"
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in COLUMNS} for r in got)
    write_robustness(path, tmp_path, tmp_path, 0.95)
    with (tmp_path / "robustness.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert [r["method"] for r in table] == ["frozen_encoder", "fedavg_peft", "past_v2"]
    want = summarize([{k: str(v) for k, v in r.items()} for r in got])
    assert float(table[1]["ri_mean"]) == pytest.approx(want[1]["ri_mean"], abs=1e-6)
    assert (tmp_path / "robustness.png").stat().st_size > 10_000
    assert (tmp_path / "robustness.png.prov.json").exists() and "Site robustness" in (tmp_path / "robustness.md").read_text()


def test_the_methods_guide_reading_is_the_renderers_output_on_the_recorded_rows():
    """The block `fedhisto records` writes from benchmarks/records/robustness holds the renderer's reading of
    the recorded robustness.csv, word for word."""
    from fedhisto.metrics.robustness_reading import read_robustness_csv, render, robustness_reading

    guide = (REPO / "docs/methods.md").read_text()
    block = guide.split("<!-- generated:robustness begin -->")[1].split("<!-- generated:robustness end -->")[0]
    record = REPO / "benchmarks/records/robustness"
    body = render(record)
    assert body == robustness_reading(read_robustness_csv(record / "metrics/robustness.csv"))
    assert block.endswith(body) and "Reading:" in body


def test_a_stain_aware_method_counts_as_better_only_beyond_two_standard_errors_of_the_seed_differences():
    from scipy.stats import sem

    from fedhisto.metrics.robustness import compare
    from fedhisto.metrics.robustness_reading import better

    def rows(method: str, apd: list[float]) -> list[dict]:
        return [{"method": method, "seed": s, "model": "global", "encoder_state": "adapted", "ri": 0.9, "apd": a}
                for s, a in zip((11, 22, 33, 44, 55), apd, strict=True)]

    ref = [-0.07, -0.07, -0.06, 0.02, -0.01]
    noisy = [-0.05, -0.06, -0.03, 0.00, -0.05]  # the embedded default's v2 against FedAvg-PEFT: +0.0006 on average
    c = compare(rows("past_v2", noisy) + rows("fedavg_peft", ref), "past_v2", "fedavg_peft")
    diffs = [a - b for a, b in zip(noisy, ref, strict=True)]
    assert c["apd"]["difference_se"] == pytest.approx(sem(diffs)) and c["apd"]["higher_in"] == 3
    assert not better(c, "apd")  # 3 of 5 seeds higher, mean far inside the seed-to-seed spread
    clear = [a + 0.03 + 0.001 * k for k, a in enumerate(ref)]
    c = compare(rows("past_v2", clear) + rows("fedavg_peft", ref), "past_v2", "fedavg_peft")
    assert better(c, "apd") and c["apd"]["difference_mean"] > 2 * sem([a - b for a, b in zip(clear, ref, strict=True)])
