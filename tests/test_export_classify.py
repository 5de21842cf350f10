"""``fedhisto export`` and ``fedhisto classify``: a package of two tiny past_v2 seeds reproduces the
pipeline's own ensemble, its LoRA loads through peft, and bad input is refused or listed, never half-written."""

from __future__ import annotations

import copy
import csv
import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, write_image
from PIL import Image
from study_layouts import save_random_hibou_b

from fedhisto import CLASSES

SEEDS = [11, 33]


def _tiny_two_seeds() -> dict:
    tiny = copy.deepcopy(TINY)
    tiny["train"].update(seeds=SEEDS, ablation_seeds=SEEDS, max_rounds=1)
    return tiny


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory) -> dict:
    """Two one-round past_v2 seeds on the shared tiny cohort, predicted and exported, laid out as a
    pipeline's results/ folder (the README's commands run in ``work``)."""
    from fedhisto.config.study import load_config
    from fedhisto.export.stage import run_export
    from fedhisto.predict.stage import run_predict_seeds
    from fedhisto.train.stage import run_train

    root = tmp_path_factory.mktemp("export")
    work = root / "work"
    (work / "config").mkdir(parents=True)
    tiny = _tiny_two_seeds()
    (work / "config/config.yaml").write_text(yaml.safe_dump(tiny))
    cfg = load_config(tiny)
    results = work / "results"
    for name in ("stain", "manifest", "cohort"):
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).symlink_to(prepared["root"] / name)
    train, preds = results / "train/past_v2", results / "predictions/past_v2"
    for s in SEEDS:
        run_train("past_v2", s, prepared["manifest"], prepared["identity"], prepared["descriptors"], cfg,
                  train / f"seed{s}")
    run_predict_seeds("past_v2", [(s, train / f"seed{s}", preds / f"seed{s}") for s in SEEDS], prepared["manifest"],
                      prepared["identity"], prepared["descriptors"], cfg)
    pkg = root / "pkg"
    run_export("past_v2", cfg, pkg, results / "train", results / "predictions", prepared["descriptors"],
               prepared["identity"])
    with Path(prepared["manifest"]).open() as fh:
        external = [r for r in csv.DictReader(fh) if r["split"] == "external"]
    return {"root": root, "work": work, "cfg": cfg, "pkg": pkg, "preds": preds, "train": train,
            "images": prepared["images"] / "images/external", "external": external}


def classify(*args: str) -> int:
    from fedhisto.cli import main

    return main(["classify", *args])


def read_csv(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def pipeline_ensemble(run: dict) -> dict[str, tuple[int, np.ndarray]]:
    """The pipeline's own ensemble (metrics stage) keyed by image path relative to the external folder."""
    from fedhisto.stats.prediction_files import ensemble

    ids, y, probs = ensemble([run["preds"] / f"seed{s}/external.csv" for s in SEEDS])
    path_of = {r["sample_id"]: Path(r["path"]).resolve().relative_to(run["images"].resolve()).as_posix()
               for r in run["external"]}
    return {path_of[i]: (int(y[k]), probs[k]) for k, i in enumerate(ids)}


def test_uncalibrated_centroid_classification_equals_the_pipeline_ensemble(run, tmp_path):
    out = tmp_path / "preds.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(out),
                    "--no-calibration", "--descriptor", "centroid") == 0
    rows = read_csv(out)
    expected = pipeline_ensemble(run)
    n_files = sum(1 for p in run["images"].rglob("*") if p.is_file())
    assert len(rows) == n_files == len(expected) == len(run["external"]) == 32  # one row per image (tiny profile)
    assert list(rows[0])[:5] == ["image", "p_ACA", "p_Normal", "p_SCC", "label"]
    got = np.array([[float(r[f"p_{c}"]) for c in CLASSES] for r in rows])
    want = np.array([expected[r["image"]][1] for r in rows])
    # the pipeline's files round to 8 decimals and average after; ours average then round: <= 1e-8 apart
    assert np.abs(got - want).max() < 1e-6
    assert [r["label"] for r in rows] == [CLASSES[int(p.argmax())] for p in want]
    assert {k for k in rows[0] if k.startswith("label_")} == {f"label_seed{s}" for s in SEEDS}
    assert {r["descriptor"] for r in rows} == {"centroid"} and {r["converted"] for r in rows} == {""}
    assert read_csv(tmp_path / "preds.exclusions.csv") == []
    assert (tmp_path / "preds.contact_sheet.png").stat().st_size > 0
    assert (tmp_path / "preds.csv.prov.json").exists()


def test_calibrated_probabilities_use_the_validation_fitted_temperature(run, tmp_path):
    from fedhisto.stats.prediction_files import ensemble
    from fedhisto.stats.temperature import apply_temperature, fit_temperature

    meta = json.loads((run["pkg"] / "package.json").read_text())
    _, y, p = ensemble([run["train"] / f"seed{s}/validation_predictions.csv" for s in SEEDS])
    assert meta["temperature"]["value"] == pytest.approx(fit_temperature(p, y), rel=1e-12)
    assert "global validation set" in meta["temperature"]["fitted_on"] and meta["temperature"]["n"] == len(y)
    out = tmp_path / "cal.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(out)) == 0
    rows = read_csv(out)
    expected = pipeline_ensemble(run)
    raw = np.array([expected[r["image"]][1] for r in rows])
    got = np.array([[float(r[f"p_{c}"]) for c in CLASSES] for r in rows])
    assert np.abs(got - apply_temperature(raw, meta["temperature"]["value"])).max() < 1e-6
    summary = json.loads((tmp_path / "cal.json").read_text())
    assert summary["descriptor"]["used"] == "centroid"  # the documented default
    uncertain = [r for r in rows if float(r["confidence"]) < 0.6 or len({r[f"label_seed{s}"] for s in SEEDS}) > 1]
    assert summary["uncertain"]["count"] == len(uncertain) == sum(r["uncertain"] == "yes" for r in rows)


def test_labels_add_metrics_with_bootstrap_intervals(run, tmp_path):
    from fedhisto.stats.scores import classification_metrics
    from fedhisto.stats.temperature import apply_temperature

    expected = pipeline_ensemble(run)
    labels = tmp_path / "labels.csv"
    labels.write_text("image,label\n" + "".join(f"{k},{CLASSES[v[0]]}\n" for k, v in expected.items()))
    out = tmp_path / "p.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(out),
                    "--labels", str(labels)) == 0
    m = json.loads((tmp_path / "p.json").read_text())["metrics"]
    t = json.loads((run["pkg"] / "package.json").read_text())["temperature"]["value"]
    keys = sorted(expected)
    want = classification_metrics(apply_temperature(np.array([expected[k][1] for k in keys]), t),
                                  np.array([expected[k][0] for k in keys]))
    assert m["labelled"] == 32 and m["unlabelled"] == 0
    assert m["point"]["macro_f1"] == pytest.approx(want["macro_f1"], abs=1e-12)
    ci = m["intervals"]["macro_f1"]
    assert ci["ci_low"] <= m["point"]["macro_f1"] <= ci["ci_high"] and ci["n_resamples"] > 0
    labels.write_text("image,label\nnot_there.jpg,ACA\n")
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(tmp_path / "q.csv"),
                    "--labels", str(labels)) == 2
    assert not (tmp_path / "q.csv").exists()


def test_package_holds_no_pickle_and_says_what_it_is(run):
    from safetensors import safe_open

    pkg = run["pkg"]
    files = [p for p in pkg.rglob("*") if p.is_file()]
    assert all(p.suffix in (".json", ".safetensors", ".md", "") for p in files), files
    for p in files:
        assert not p.read_bytes().startswith(b"PK\x03\x04")  # torch.save's zip container
        if p.suffix == ".safetensors":
            with safe_open(str(p), "pt") as f:
                assert list(f.keys())
    meta = json.loads((pkg / "package.json").read_text())
    assert meta["classes"] == list(CLASSES) and meta["encoder"]["name"] == "tiny"
    assert meta["encoder"]["included"] == "encoder/"
    assert [m["seed"] for m in meta["members"]] == SEEDS
    assert all(len(m["identity"]["dataset_identity"]) == 64 for m in meta["members"])
    d = meta["descriptor"]
    assert d["kind"] == "stain" and d["default"] == "centroid" and len(d["centroid"]) == 14
    assert len(d["standardisation"]["mean"]) == 14 and meta["code"]["source_digest"]
    card = json.loads((pkg / "model_card.json").read_text())
    assert set(card["metrics"]) == {"internal (global test)", "external cohort"}
    ext = card["metrics"]["external cohort"]
    assert ext["n"] == 32 and ext["intervals"]["macro_f1"]["ci_low"] <= ext["macro_f1"]
    assert "macro-F1" in (pkg / "model_card.md").read_text()
    sums = (pkg / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == len(files) - 1


def test_lora_loads_through_peft_on_the_tiny_encoder(run):
    from peft import PeftModel

    from fedhisto.classify.runner import build_package_model
    from fedhisto.export.package import load_package
    from fedhisto.model.encoder import load_encoder_folder, pooled_embedding

    pkg = load_package(run["pkg"])
    enc = load_encoder_folder(run["pkg"] / "encoder", "tiny")
    peft_model = PeftModel.from_pretrained(enc.module, run["pkg"] / "members/seed11/lora")
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    state = pkg.members["seed11"]
    ours = {n: t for n, t in state.items() if "lora_" in n}
    assert len(lora) == len(ours) > 0
    for n, p in lora.items():  # base_model.model.<module>.lora_A.default.weight <-> encoder.<module>...
        assert torch.equal(p.detach(), ours["encoder." + n.removeprefix("base_model.model.")])
    assert any(t.abs().sum() > 0 for n, t in ours.items() if "lora_B" in n)  # trained: LoRA is not the identity
    model = build_package_model(pkg)
    model.load_trainable_state(state)
    model.eval()
    peft_model.eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert torch.allclose(pooled_embedding(enc.entry, peft_model.get_base_model(), x),
                              model.encoder_embedding(x), atol=1e-6)


def test_lora_loads_through_peft_on_a_hibou_b_folder(tmp_path):
    from peft import PeftModel

    from fedhisto.config.model_settings import ModelConfig
    from fedhisto.export.package import PEFT_PREFIX, adapter_config, read_member, split_state, write_member
    from fedhisto.model.encoder import load_encoder_folder, pooled_embedding
    from fedhisto.model.peft_model import FedHistoModel

    folder = save_random_hibou_b(tmp_path / "hibou", seed=3)
    mcfg = ModelConfig.model_validate({"encoder": {"name": "hibou-b", "local_dir": str(folder)},
                                       "adapter_hidden": 16, "film_hidden": 16})
    model = FedHistoModel(load_encoder_folder(folder, "hibou-b"), mcfg, film=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    state = model.trainable_state()
    lora, _ = split_state(state)
    targets = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in lora})
    assert len(targets) == 12 * 4  # query, key, value, attention output in each of HIBOU-B's twelve blocks
    write_member(tmp_path / "m", state, adapter_config(mcfg.model_dump(mode="json"), targets, "histai/hibou-b"))
    assert all(torch.equal(state[k], v) for k, v in read_member(tmp_path / "m").items())
    enc = load_encoder_folder(folder, "hibou-b")
    peft_model = PeftModel.from_pretrained(enc.module, tmp_path / "m/lora")
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(lora)
    for n, p in loaded.items():
        assert torch.equal(p.detach(), state["encoder." + n.removeprefix("base_model.model.")])
    model.eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(pooled_embedding(enc.entry, peft_model.get_base_model(), x),
                              model.encoder_embedding(x), atol=1e-5)


def test_a_package_is_refused_with_another_encoder_or_a_corrupted_tensor(run, tmp_path, capsys):
    from fedhisto.export.package import PackageError, load_package

    with pytest.raises(PackageError, match="trained on encoder 'tiny', not 'hibou-b'"):
        load_package(run["pkg"], expect_encoder="hibou-b")
    folder = save_random_hibou_b(tmp_path / "hibou", seed=3, depth=2)  # only its kind is read: the refusal names it
    out = tmp_path / "x.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(out),
                    "--encoder-dir", str(folder)) == 2
    assert "trained on ('tiny'" in capsys.readouterr().err
    bad = tmp_path / "pkg"
    shutil.copytree(run["pkg"], bad)
    head = bad / "members/seed33/head.safetensors"
    data = bytearray(head.read_bytes())
    data[-3] ^= 0xFF
    head.write_bytes(bytes(data))
    assert classify("--model", str(bad), "--images", str(run["images"]), "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "members/seed33/head.safetensors: SHA-256 differs" in err
    assert not out.exists() and not list(tmp_path.glob("x.*"))


def huge_png(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares width x height (its pixel data is a stub: it is refused before decoding)."""
    write_image(path, size=4)
    data = bytearray(path.read_bytes())
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    path.write_bytes(bytes(data))
    return path


def test_bad_images_are_converted_or_listed_and_an_empty_folder_is_an_error(run, tmp_path, capsys):
    src = tmp_path / "site"
    rgb = np.asarray(Image.open(next(run["images"].rglob("*.jpg"))).convert("RGB"))
    (src / "sub").mkdir(parents=True)
    Image.fromarray(rgb).convert("L").save(src / "grey.png")
    Image.fromarray(rgb).convert("RGBA").save(src / "rgba.png")
    Image.fromarray(rgb).convert("CMYK").save(src / "cmyk.jpg")
    Image.fromarray(rgb[..., 0].astype(np.uint16) * 257).save(src / "sixteen.png")
    Image.fromarray(rgb).save(src / "sub/plain.tif")
    (src / "notes.txt").write_text("not an image")
    (src / ".DS_Store").write_bytes(b"\0\1")
    (src / "broken.png").write_bytes((src / "grey.png").read_bytes()[:60])
    huge_png(src / "huge.png", 60000, 50000)
    out = tmp_path / "o.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(src), "--out", str(out)) == 0
    rows = {r["image"]: r for r in read_csv(out)}
    assert sorted(rows) == ["cmyk.jpg", "grey.png", "rgba.png", "sixteen.png", "sub/plain.tif"]
    assert rows["grey.png"]["converted"] == "greyscale -> RGB"
    assert rows["rgba.png"]["converted"] == "RGBA composited on white -> RGB"
    assert rows["cmyk.jpg"]["converted"] == "CMYK -> RGB"
    assert "16-bit" in rows["sixteen.png"]["converted"] and rows["sub/plain.tif"]["converted"] == ""
    excl = {r["image"]: r["reason"] for r in read_csv(tmp_path / "o.exclusions.csv")}
    assert sorted(excl) == [".DS_Store", "broken.png", "huge.png", "notes.txt"]
    assert "not an image" in excl["notes.txt"] and "hidden" in excl[".DS_Store"]
    assert "60000 x 50000 pixels (3000 MP)" in excl["huge.png"] and "unreadable" in excl["broken.png"]
    summary = json.loads((tmp_path / "o.json").read_text())
    assert summary["classified"] == 5 and summary["excluded"] == 4 and summary["converted"] == 4

    empty = tmp_path / "empty"
    empty.mkdir()
    assert classify("--model", str(run["pkg"]), "--images", str(empty), "--out", str(tmp_path / "e.csv")) == 2
    assert "the folder is empty" in capsys.readouterr().err
    (empty / "readme.txt").write_text("x")
    assert classify("--model", str(run["pkg"]), "--images", str(empty), "--out", str(tmp_path / "e.csv")) == 2
    assert "no classifiable image" in capsys.readouterr().err
    assert not list(tmp_path.glob("e.*"))


def test_site_descriptor_is_the_stain_estimator_standardised_and_falls_back_on_blank_tiles(run, tmp_path):
    from fedhisto.config.data_settings import StainConfig
    from fedhisto.stain.stage import client_descriptor

    meta = json.loads((run["pkg"] / "package.json").read_text())
    out = tmp_path / "s.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(out),
                    "--descriptor", "site") == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    paths = sorted(p for p in run["images"].rglob("*") if p.is_file())
    est = client_descriptor([str(p) for p in paths], StainConfig.model_validate(meta["descriptor"]["estimator"]))
    std = meta["descriptor"]["standardisation"]
    want = (np.asarray(est["raw"]) - std["mean"]) / np.asarray(std["sd"])
    assert summary["descriptor"]["used"] == "site"
    assert np.allclose(summary["descriptor"]["value"], want, atol=1e-5)  # float32 in the summary
    assert {r["descriptor"] for r in read_csv(out)} == {"site"}

    blank = tmp_path / "blank"
    for k in range(3):
        blank.mkdir(exist_ok=True)
        Image.new("RGB", (64, 64), (250, 250, 250)).save(blank / f"b{k}.png")
    assert classify("--model", str(run["pkg"]), "--images", str(blank), "--out", str(tmp_path / "b.csv"),
                    "--descriptor", "site") == 0
    summary = json.loads((tmp_path / "b.json").read_text())
    assert "fallback" in summary["descriptor"] and summary["descriptor"]["tissue_pixels"] == 0
    assert summary["descriptor"]["value"] == pytest.approx(meta["descriptor"]["centroid"])
    assert {r["descriptor"] for r in read_csv(tmp_path / "b.csv")} == {"centroid (site fallback: too little tissue)"}


def readme_use_commands(repo: Path) -> list[str]:
    text = (repo / "README.md").read_text()
    section = text.split("## Use the model", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("fedhisto ")]


def test_readme_use_the_model_commands_run(run, repo):
    commands = readme_use_commands(repo)
    assert [c.split()[1] for c in commands] == ["export", "classify"]
    exe = shutil.which("fedhisto")
    for c in commands:
        proc = subprocess.run([exe, *c.split()[1:]], cwd=run["work"], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(run["work"] / "preds.csv")
    assert len(rows) == 32 and list(rows[0])[:5] == ["image", "p_ACA", "p_Normal", "p_SCC", "label"]


def test_export_takes_the_runs_own_configfile_list_later_files_win(run, tmp_path, capsys):
    """`fedhisto export --configfile A B` reads the config as `snakemake --configfile A B` did: B laid over A,
    over nothing else. A alone names seeds that never trained (refused, naming the missing seed); A then B
    is the run's config, and the package equals the one made from that config as one file."""
    from fedhisto.cli import main

    base, overlay = tmp_path / "a.yaml", tmp_path / "b.yaml"
    wrong = copy.deepcopy(_tiny_two_seeds())
    wrong["train"].update(seeds=[99], ablation_seeds=[99])
    base.write_text(yaml.safe_dump(wrong))
    overlay.write_text(yaml.safe_dump({"train": {"seeds": SEEDS, "ablation_seeds": SEEDS}}))
    paths = ["--train", str(run["work"] / "results/train"), "--predictions", str(run["work"] / "results/predictions"),
             "--descriptors", str(run["work"] / "results/stain/descriptors.json"),
             "--manifest-json", str(run["work"] / "results/manifest/manifest.json")]
    assert main(["export", "--out", str(tmp_path / "reversed"), "--configfile", str(overlay), str(base), *paths]) == 2
    assert "seed99" in capsys.readouterr().err and not (tmp_path / "reversed").exists()
    assert main(["export", "--out", str(tmp_path / "pkg"), "--configfile", str(base), str(overlay), *paths]) == 0
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(_tiny_two_seeds()))
    assert main(["export", "--out", str(tmp_path / "one"), "--config", str(one), *paths]) == 0
    members = sorted(p.relative_to(tmp_path / "one").as_posix() for p in (tmp_path / "one/members").rglob("*"))
    assert members == sorted(p.relative_to(tmp_path / "pkg").as_posix() for p in (tmp_path / "pkg/members").rglob("*"))
    for name in members:
        if (tmp_path / "one" / name).is_file():
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "pkg" / name).read_bytes(), name
    assert main(["export", "--out", str(tmp_path / "both"), "--config", str(one), "--configfile", str(base),
                 *paths]) == 2
    assert "not both" in capsys.readouterr().err


def planned_jobs(snakemake_bin: str, repo: Path, workdir: Path, *extra: str) -> dict[str, int]:
    """Rule -> job count of a dry run of ``all`` (Snakemake's job-stats table)."""
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(workdir), "-n", "--quiet",
                           "rules", "all", *extra], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            counts[parts[0]] = int(parts[1])
    assert counts, proc.stdout[-2000:]
    return counts


def test_a_classify_folder_adds_only_export_and_classify_jobs(tmp_path, repo, snakemake_bin):
    from conftest import write_tiny_config

    from fedhisto.config.stage_blocks import stage_block
    from fedhisto.config.study import load_config_file

    path = write_tiny_config(tmp_path)
    before = planned_jobs(snakemake_bin, repo, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["classify"] = {"folders": {"ext": "results/cohort/images/external", "site": str(tmp_path / "site")}}
    with_folders = tmp_path / "with_classify.yaml"
    with_folders.write_text(yaml.safe_dump(cfg))
    after = planned_jobs(snakemake_bin, repo, tmp_path, "--configfile", str(with_folders))
    added = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    assert {k: v for k, v in added.items() if v} == {"export_model": 1, "classify_folder": 2}
    a, b = load_config_file(path), load_config_file(with_folders)
    for method, seed in a.train_runs():  # no training identity reads the block
        assert stage_block(a, "train", method=method, seed=seed) == stage_block(b, "train", method=method, seed=seed)
    cfg["classify"]["method"] = "scaffold"  # not trained by the tiny config
    with_folders.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([snakemake_bin, "-s", str(repo / "Snakefile"), "-d", str(tmp_path), "-n", "all",
                           "--configfile", str(with_folders)], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "classify.method 'scaffold' is not trained by this config" in proc.stdout + proc.stderr


def test_export_is_complete_or_absent(run, tmp_path, monkeypatch):
    from fedhisto.export import package
    from fedhisto.export.stage import run_export

    results = run["work"] / "results"
    args = ("past_v2", run["cfg"], tmp_path / "pkg", results / "train", results / "predictions",
            results / "stain/descriptors.json", results / "manifest/manifest.json")
    with pytest.raises(package.PackageError, match="exists and is not empty"):
        run_export(*args[:2], run["pkg"], *args[3:])
    calls = []

    def fail_on_second(folder, state, lora_config, real=package.write_member):
        calls.append(folder)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real(folder, state, lora_config)

    monkeypatch.setattr(package, "write_member", fail_on_second)
    with pytest.raises(OSError, match="disk full"):
        run_export(*args)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []  # no package, no temporary folder left


# ---------------------------------------------------------------- the domain check and the model card's data


def linked_folder(rows: list[dict], folder: Path) -> Path:
    """The manifest rows' images under one folder (site-prefixed names: the sites reuse file names)."""
    folder.mkdir(parents=True)
    for r in rows:
        (folder / f"{r['site']}_{Path(r['path']).name}").symlink_to(r["path"])
    return folder


def manifest_rows(prepared: dict, split: str) -> list[dict]:
    with Path(prepared["manifest"]).open() as fh:
        return [r for r in csv.DictReader(fh) if r["split"] == split]


def test_domain_statistics_pool_the_sites_sums_as_scikit_learn_and_scipy_compute_them():
    from scipy.spatial.distance import mahalanobis
    from sklearn.covariance import OAS

    from fedhisto.export.domain_stats import embedding_statistics, mahalanobis_scores, site_statistics

    rng = np.random.default_rng(5)
    sites, xs, ys = [], [], []
    for k, n in enumerate((40, 25, 60)):  # three sites, one without class 2 (as C5 has no SCC)
        y = rng.integers(0, 2 if k == 1 else 3, n)
        x = rng.normal(size=(n, 12)) + 3 * np.eye(3, 12)[y] + 0.5 * k
        sites.append(site_statistics(x, y, 3))
        xs.append(x)
        ys.append(y)
    x, y = np.concatenate(xs), np.concatenate(ys)
    stats = embedding_statistics(sites)
    means = np.stack([x[y == c].mean(0) for c in range(3)])
    assert np.allclose(stats["class_means"], means, atol=1e-5)
    assert stats["class_counts"].tolist() == np.bincount(y, minlength=3).tolist()
    oas = OAS(assume_centered=True).fit(x - means[y])  # the within-class covariance, shrunk as scikit-learn does
    assert np.allclose(stats["covariance"], oas.covariance_, atol=1e-5)
    assert stats["shrinkage"][0] == pytest.approx(oas.shrinkage_, rel=1e-5)
    z = rng.normal(size=(7, 12)) * 2
    vi = np.linalg.inv(oas.covariance_)
    want = [min(mahalanobis(v, mu, vi) for mu in means) for v in z]
    assert np.allclose(mahalanobis_scores(z, stats), want, rtol=1e-4)


def test_the_conformal_threshold_keeps_its_stated_false_flag_rate():
    from fedhisto.export.domain_stats import conformal_threshold

    s = np.arange(1, 40)[::-1].astype(float)  # 39 scores: k = ceil(40 * 0.95) = 38, the 38th smallest
    t = conformal_threshold(s, 0.05)
    assert (t["k"], t["threshold"], t["calibration_flagged"], t["reachable"]) == (38, 38.0, 1, True)
    assert t["bound"] == pytest.approx(1 - 38 / 40)
    small = conformal_threshold(s[:9], 0.05)  # 9 scores cannot reach 5 %: the largest, bound 1 / 10
    assert (small["threshold"], small["bound"], small["reachable"]) == (39.0, pytest.approx(0.1), False)
    # exchangeable in-domain images: flagged at most at the bound (20,000 draws: SE 0.0015)
    rng = np.random.default_rng(0)
    flags = []
    for _ in range(20_000):
        draw = rng.gamma(3.0, size=40)
        flags.append(draw[39] > conformal_threshold(draw[:39], 0.05)["threshold"])
    assert np.mean(flags) <= 0.05 + 3 * 0.0015


@pytest.fixture(scope="module")
def folders(run, prepared, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("domain")
    return {split: linked_folder(manifest_rows(prepared, split), root / split) for split in ("holdout", "test")}


def test_classify_flags_the_external_site_and_keeps_the_internal_test_in_domain(run, folders, tmp_path, capsys):
    out = tmp_path / "ext.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(run["images"]), "--out", str(out)) == 0
    rows = read_csv(out)
    assert {"ood_score", "in_domain"} <= set(rows[0]) and {r["in_domain"] for r in rows} <= {"yes", "no"}
    domain = json.loads((tmp_path / "ext.json").read_text())["domain"]
    flagged = sum(r["in_domain"] == "no" for r in rows)
    assert domain["verdict"] == "outside" and domain["line"].startswith("the folder is OUTSIDE what the model saw")
    assert flagged == domain["embedding"]["flagged"] and flagged >= len(rows) / 2  # the shifted stain and scanner
    logged = [line for line in capsys.readouterr().err.splitlines() if "classify: domain:" in line]
    assert len(logged) == 1 and logged[0].endswith(f"classify: domain: {domain['line']}")
    assert domain["descriptor"]["available"] and domain["descriptor"]["mahalanobis"] > 0

    out = tmp_path / "test.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(folders["test"]), "--out", str(out)) == 0
    rows = read_csv(out)
    domain = json.loads((tmp_path / "test.json").read_text())["domain"]
    # unshifted internal images never used for calibration: mostly in domain (the tiny cohort's 12 holdout
    # images set the threshold at their largest score, so the bound is 1/13 and a few flags are expected)
    assert domain["verdict"] == "within" and domain["line"].startswith("the folder is within what the model saw")
    assert sum(r["in_domain"] == "no" for r in rows) <= len(rows) / 3


def test_the_false_flag_rate_is_stated_and_holds_on_the_calibration_holdouts(run, folders, prepared, tmp_path):
    meta = json.loads((run["pkg"] / "package.json").read_text())
    calibration = meta["domain"]["embedding"]["calibration"]
    holdouts = manifest_rows(prepared, "holdout")
    assert calibration["n"] == len(holdouts) == sum(len(v) for v in calibration["scores"].values())
    out = tmp_path / "h.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(folders["holdout"]), "--out", str(out),
                    "--false-flag-rate", "0.25") == 0
    rows = read_csv(out)
    domain = json.loads((tmp_path / "h.json").read_text())["domain"]
    thr = domain["embedding"]["threshold"]
    n = len(holdouts)
    k = int(np.ceil((n + 1) * 0.75))  # the conformal rank, written afresh
    assert domain["false_flag_rate"] == 0.25 and thr["k"] == k and thr["bound"] == pytest.approx(1 - k / (n + 1))
    assert thr["bound"] <= 0.25 and domain["calibration_images"] == n
    # the calibration images scored again by classify: their own scores, so exactly n - k of them are flagged
    scores = sorted(float(r["ood_score"]) for r in rows)
    stored = sorted(s for v in calibration["scores"].values() for s in v)
    assert np.allclose(scores, stored, rtol=1e-5)
    assert sum(r["in_domain"] == "no" for r in rows) == n - k == thr["calibration_flagged"]


def _leave_one_site_out_afresh(scores: dict[str, list[float]], rate: float) -> dict[str, float]:
    """Split conformal prediction (Vovk et al.; Angelopoulos & Bates 2021, eq. 1), one site held out at a time:
    the threshold is the ceil((n + 1)(1 - rate))-th smallest of the other sites' n scores (the largest when
    that rank passes n), and the rate is the share of the held-out site's scores above it."""
    out = {}
    for site, own in scores.items():
        others = np.sort(np.concatenate([v for s, v in scores.items() if s != site]))
        rank = min(len(others), int(np.ceil((len(others) + 1) * (1 - rate))))
        out[site] = float(np.mean(np.asarray(own) > others[rank - 1] * (1 + 1e-5)))
    return out


def test_the_false_flag_rate_on_a_site_the_threshold_never_saw_is_stated_in_card_and_json(run, folders, tmp_path):
    meta = json.loads((run["pkg"] / "package.json").read_text())
    emb = meta["domain"]["embedding"]
    scores = emb["calibration"]["scores"]
    assert len(scores) >= 2  # the tiny cohort's sites each score their holdout
    loso = emb["leave_one_site_out"]
    want = _leave_one_site_out_afresh(scores, 0.05)
    assert loso["rate"] == 0.05 and {s: v["rate"] for s, v in loso["sites"].items()} == pytest.approx(want)
    n = sum(len(v) for v in scores.values())
    assert loso["images"] == n and loso["pooled_rate"] == pytest.approx(
        sum(want[s] * len(v) for s, v in scores.items()) / n)
    card = json.loads((run["pkg"] / "model_card.json").read_text())["domain_check"]
    thr = emb["default_threshold"]
    assert card == {"rate": 0.05, "calibration_images": n, "threshold": thr["threshold"], "bound": thr["bound"],
                    "leave_one_site_out": {"pooled_rate": loso["pooled_rate"], "images": n,
                                           "sites": {s: v["rate"] for s, v in loso["sites"].items()}}}
    md = (run["pkg"] / "model_card.md").read_text()
    assert "## Domain check" in md and f"{loso['pooled_rate']:.1%} of {n} images flagged" in md
    assert f"at most {thr['bound']:.1%}" in md
    # classify states it at the rate it was asked for
    out = tmp_path / "h.csv"
    assert classify("--model", str(run["pkg"]), "--images", str(folders["holdout"]), "--out", str(out),
                    "--false-flag-rate", "0.25") == 0
    got = json.loads((tmp_path / "h.json").read_text())["domain"]["embedding"]["leave_one_site_out"]
    assert got["rate"] == 0.25
    assert {s: v["rate"] for s, v in got["sites"].items()} == pytest.approx(_leave_one_site_out_afresh(scores, 0.25))


def test_the_model_card_names_its_data_and_says_demonstration(run, prepared):
    from safetensors.numpy import load_file

    card_md = (run["pkg"] / "model_card.md").read_text()
    assert card_md.splitlines()[0].startswith("**Demonstration model, not for real tissue.**")
    card = json.loads((run["pkg"] / "model_card.json").read_text())
    data = card["data"]
    assert card["demonstration"] and data["demonstration"] and data["kind"] == "synthetic"
    assert data["sources"] == [{"source": "synthetic", "kind": "synthetic", "images": len(read_csv(Path(prepared["manifest"]))),
                                "cohorts": ["external", "internal"]}]
    rows = read_csv(Path(prepared["manifest"]))
    for client, v in data["training_sites"].items():
        for split in ("optimisation", "holdout"):
            want = {c: sum(r["client"] == client and r["split"] == split and r["label"] == c for r in rows)
                    for c in CLASSES}
            assert v[split] == want, (client, split)
        assert v["sites"] == [f"site{client[1]}"]
    assert data["evaluation"]["external cohort"]["images"] == 32
    assert "randomly initialised" in data["encoder"]["weights"]  # TINY: require_pretrained false
    assert len(data["descriptor_range"]["raw_min"]) == 14 and "## Data" in card_md
    assert "| C1 | site1 (synthetic) |" in card_md and "demonstrat" in card["limitations"][0].lower()
    for s in SEEDS:
        stats = load_file(str(run["pkg"] / f"members/seed{s}/domain.safetensors"))
        assert set(stats) == {"class_means", "class_counts", "covariance", "shrinkage"}
        assert stats["covariance"].shape == (64, 64) and stats["class_counts"].sum() > 0


def test_a_package_without_domain_statistics_still_classifies_and_says_so(run, tmp_path):
    from fedhisto.export.package import DOMAIN_FILE, write_checksums

    old = tmp_path / "old"
    shutil.copytree(run["pkg"], old)
    meta = json.loads((old / "package.json").read_text())
    del meta["domain"]
    (old / "package.json").write_text(json.dumps(meta))
    for p in old.rglob(DOMAIN_FILE):
        p.unlink()
    (old / "SHA256SUMS").unlink()
    write_checksums(old)
    out = tmp_path / "o.csv"
    assert classify("--model", str(old), "--images", str(run["images"]), "--out", str(out)) == 0
    assert {(r["ood_score"], r["in_domain"]) for r in read_csv(out)} == {("", "")}
    domain = json.loads((tmp_path / "o.json").read_text())["domain"]
    assert domain["verdict"] == "unknown" and "export it again" in domain["line"]
