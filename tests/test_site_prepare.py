"""Site-local preparation (issue 24 item 1), the coordinator's cross-site checks (item 2) and the code
identity (item 5) on a five-site fixture the test renders itself (``fedhisto.synth``).

The central reference is the pipeline's own stages on the same images (csv sources -> clearance ->
manifest -> stain); each site is prepared from its own folder with an open audit that records every
path the process opens, and the coordinator works from the five ``upload.json`` files alone.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_lint_clean
from PIL import Image

from fedhisto import CLASSES
from fedhisto.config.study import SyntheticCohort, load_config
from fedhisto.federation.coordinator import UploadsRefused, check_uploads
from fedhisto.federation.prepare import prepare_site
from fedhisto.federation.upload import read_upload
from fedhisto.infra.code_identity import (
    CodeMismatch,
    check_code,
    code_identity,
    identity_strings,
    source_digest,
)
from fedhisto.manifest.stage import MANIFEST_COLUMNS

_OPENED: list[str] = []
_RECORDING = [False]


def _audit(event: str, args: tuple) -> None:
    if _RECORDING[0] and event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # hooks cannot be removed; it records only while _RECORDING is set

SITES = {"C1": "site1", "C2": "site2", "C3": "site3", "C4": "site4", "C5": "site5"}
PER_CLASS = {"site1": (4, 3, 4), "site2": (5, 4, 2), "site3": (3, 3, 5), "site4": (2, 2, 6), "site5": (5, 6, 0)}
FOLDER = {"ACA": "lung_aca", "Normal": "lung_n", "SCC": "lung_scc"}  # aliases the folder layout accepts


def _render(root: Path) -> dict[str, Path]:
    """Five site folders of originals, plus planted copies: an exact copy of a site1 image filed at
    site2, a mirrored copy of a site3 image at site4 (cross-site), a re-encode within site5."""
    from fedhisto.synth.embedded_cohort import Member, render_original
    from fedhisto.synth.relatives import make_copy

    cfg = SyntheticCohort(image_size=96)
    key = 0
    first: dict[str, Path] = {}
    for site, counts in PER_CLASS.items():
        for cls, n in zip(CLASSES, counts, strict=True):
            for i in range(n):
                path = root / site / FOLDER[cls] / f"{cls.lower()}{i:02d}.jpeg"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(render_original(Member(site, cls, key), cfg))
                first.setdefault(f"{site}/{cls}", path)
                key += 1
    rng = np.random.default_rng(5)
    plants = [("site1/ACA", "site2", "exact"), ("site3/SCC", "site4", "dihedral"), ("site5/Normal", "site5", "jpeg")]
    for src, dest, transform in plants:
        cls = src.split("/")[1]
        data, _ = make_copy(first[src].read_bytes(), transform, rng, 25.0, 80)
        (root / dest / FOLDER[cls] / f"copy_{transform}.jpeg").write_bytes(data)
    return {c: root / s for c, s in SITES.items()}


def _config(tmp: Path, targets: dict | None = None) -> object:
    clients = targets or {c: [0, 0, 0] for c in SITES}
    return load_config({
        "cohort": {"mode": "real", "real": {"sources": [
            {"kind": "csv", "root": str(tmp / "lists" / f"{s}.csv"), "site": s, "relpath_root": str(tmp / "sites" / s)}
            for s in SITES.values()]}},
        "manifest": {"targets": {"clients": clients, "validation": [0, 0, 0], "test": [0, 0, 0]}},
        "stain": {"max_images_per_client": 6, "min_tissue_pixels": 50},  # a sample smaller than a site: k matters
        "clearance": {"n_features": 100},  # fewer keypoints: a smaller visual-word k-means, same detectors
    })


def _central(tmp: Path) -> tuple[dict, list[dict]]:
    """The pipeline's stages on the same images: sources (csv kind), clearance, manifest, stain."""
    from fedhisto.clearance.stage import run_clearance
    from fedhisto.manifest.stage import run_manifest
    from fedhisto.realdata.sources import collect_sources, write_sources_csv
    from fedhisto.stain.stage import run_stain

    for site in SITES.values():
        files = sorted((tmp / "sites" / site).rglob("*.jpeg"))
        (tmp / "lists").mkdir(exist_ok=True)
        with (tmp / "lists" / f"{site}.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "label"])
            w.writerows([[str(p), p.parent.name] for p in files])
    cfg = _config(tmp)
    rows, _ = collect_sources(cfg.cohort.real.sources)
    central = tmp / "central"
    central.mkdir()
    write_sources_csv(central / "sources.csv", rows)
    run_clearance(central / "sources.csv", cfg.clearance, central / "clearance", progress=False)
    with (central / "clearance" / "families.csv").open() as fh:
        kept = [r for r in csv.DictReader(fh) if r["keep"] == "True"]
    targets = {c: [sum(1 for r in kept if r["site"] == s and r["label"] == cls) for cls in CLASSES]
               for c, s in SITES.items()}
    cfg = _config(tmp, targets)
    run_manifest(central / "sources.csv", central / "clearance" / "families.csv", central / "clearance" / "edges.csv",
                 cfg, central / "manifest")
    doc = run_stain(central / "manifest" / "manifest.csv", cfg, central / "stain")
    with (central / "manifest" / "manifest.csv").open() as fh:
        return doc, list(csv.DictReader(fh))


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # the visual-word k-means is many small BLAS calls: threads only contend
        yield


@pytest.fixture(scope="module")
def federation(tmp_path_factory, _one_blas_thread):
    tmp = tmp_path_factory.mktemp("sites")
    folders = _render(tmp / "sites")
    central_doc, central_rows = _central(tmp)
    cfg = _config(tmp)
    opened: dict[str, list[str]] = {}

    uploads: dict[str, Path] = {}

    def prepare_all(sites, exclude: dict[str, Path] | None = None) -> dict[str, Path]:
        for site in sites:
            folder = folders[site]
            _OPENED.clear()
            _RECORDING[0] = True
            try:
                prepare_site(folder, site, tmp / "prepared" / site, cfg,
                             exclude=(exclude or {}).get(site))
            finally:
                _RECORDING[0] = False
            opened[site] = list(_OPENED)
            uploads[site] = tmp / "prepared" / site / "upload.json"
        return uploads

    prepare_all(SITES)
    _OPENED.clear()
    _RECORDING[0] = True
    try:
        first = check_uploads(list(uploads.values()), cfg, tmp / "coordinator")
    finally:
        _RECORDING[0] = False
    coordinator_opened = list(_OPENED)
    first_drops = {s: _read(tmp / "coordinator" / "drops" / f"{s}.csv") for s in SITES}
    # only sites with something to drop prepare again (an empty list changes nothing)
    prepare_all([s for s, d in first_drops.items() if d], {s: tmp / "coordinator" / "drops" / f"{s}.csv" for s in SITES})
    second = check_uploads(list(uploads.values()), cfg, tmp / "coordinator")
    return {"tmp": tmp, "cfg": cfg, "folders": folders, "central_doc": central_doc, "central_rows": central_rows,
            "uploads": uploads, "opened": opened, "coordinator_opened": coordinator_opened, "first": first,
            "first_drops": first_drops, "second": second}


def _read(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_each_site_reads_only_its_own_folder(federation):
    tmp = Path(os.path.realpath(federation["tmp"]))
    for site, paths in federation["opened"].items():
        # its images, its own outputs, and the drop list the coordinator sent it
        own = (tmp / "sites" / SITES[site], tmp / "prepared" / site, tmp / "coordinator" / "drops" / f"{site}.csv")
        under_tmp = [p for p in paths if Path(p).is_relative_to(tmp)]
        foreign = [p for p in under_tmp if not any(Path(p).is_relative_to(o) for o in own)]
        assert not foreign, f"{site} opened files of others: {foreign[:5]}"
        images_read = {p for p in under_tmp if p.endswith(".jpeg")}
        assert images_read == {os.path.realpath(p) for p in (tmp / "sites" / SITES[site]).rglob("*.jpeg")}


def test_coordinator_reads_uploads_only(federation):
    tmp = Path(os.path.realpath(federation["tmp"]))
    under_tmp = {p for p in federation["coordinator_opened"] if Path(p).is_relative_to(tmp)}
    read = {p for p in under_tmp if not Path(p).is_relative_to(tmp / "coordinator")}
    assert read == {os.path.realpath(tmp / "prepared" / s / "upload.json") for s in SITES}


def test_upload_holds_no_paths_or_pixels_and_is_small(federation):
    for site, path in federation["uploads"].items():
        text = path.read_text()
        assert "site" + SITES[site][-1] + "/" not in text and ".jpeg" not in text and str(federation["tmp"]) not in text
        up = read_upload(path, federation["cfg"])
        assert len(text) < 400 * len(up.images) + 4000  # ~300 bytes per image, never image-sized
        assert set(up.to_json()) == {"site", "role", "site_index", "code", "settings_digest", "class_counts", "images",
                                     "manifest_identity", "descriptor", "schema_version", "provenance"}


def test_hash_audit_names_the_planted_cross_site_pairs_and_drop_lists_resolve_them(federation):
    first = federation["first"]["duplicates"]
    pairs = _read(federation["tmp"] / "coordinator" / "duplicates.csv")
    assert first["unresolved_components"] == 2 and first["exact_pairs"] == 1
    assert {(p["site_a"], p["site_b"], p["match"]) for p in pairs} == {("C1", "C2", "exact"), ("C3", "C4", "phash")}
    drops = federation["first_drops"]
    assert {s: len(d) for s, d in drops.items()} == {"C1": 0, "C2": 1, "C3": 0, "C4": 1, "C5": 0}
    second = federation["second"]["duplicates"]
    assert second["unresolved_components"] == 0 and second["pending_drops_per_site"] == dict.fromkeys(SITES, 0)
    assert second["drops_per_site"] == first["drops_per_site"]  # applied drops stay listed: the lists are stable


def test_site_manifests_equal_the_central_manifest(federation):
    central = {(r["sample_id"], r["client"], r["split"]) for r in federation["central_rows"]}
    local = set()
    for site in SITES:
        rows = _read(federation["tmp"] / "prepared" / site / "manifest" / "manifest.csv")
        assert tuple(rows[0]) == MANIFEST_COLUMNS  # what a SuperNode's site.load_site_split reads
        assert {r["client"] for r in rows} == {site}
        local |= {(r["sample_id"], r["client"], r["split"]) for r in rows if r["split"] != "unused"}
    assert local == {c for c in central if c[2] != "unused"}
    assert any(c[2] == "holdout" for c in local)


def test_coordinator_descriptors_equal_the_central_stain_stage(federation):
    central = federation["central_doc"]
    fed = json.loads((federation["tmp"] / "coordinator" / "descriptors.json").read_text())
    assert list(fed["clients"]) == list(central["clients"]) == list(SITES)
    for c in SITES:  # same pixels in the same order through the same code: equal to the last bit
        for key in ("raw", "standardised", "sample_ids", "tissue_pixels", "fallback", "he_check"):
            assert fed["clients"][c][key] == central["clients"][c][key], (c, key)
    assert fed["standardisation"] == central["standardisation"]
    assert fed["centroid"] == central["centroid"]
    assert np.allclose(fed["centroid"]["standardised"], 0.0, atol=1e-9)
    assert (federation["tmp"] / "coordinator" / "descriptors.csv").read_text() == \
        (federation["tmp"] / "central" / "stain" / "descriptors.csv").read_text()


def _copy_uploads(federation, dest: Path) -> dict[str, Path]:
    out = {}
    for site, path in federation["uploads"].items():
        (dest / site).mkdir(parents=True, exist_ok=True)
        out[site] = Path(shutil.copy(path, dest / site / "upload.json"))
    return out


@pytest.mark.parametrize("breakage,reason", [
    (lambda d: d["descriptor"]["raw"].pop(), "descriptor.raw must hold 14 numbers"),
    (lambda d: d["descriptor"]["raw"].__setitem__(3, float("nan")), "non-finite"),
    (lambda d: d["code"].__setitem__("source_digest", "0" * 64), "runs other code"),
    (lambda d: d.__setitem__("settings_digest", "1" * 64), "other clearance/stain/split settings"),
    (lambda d: d.__setitem__("site_index", 0), "site_index 0"),
])
def test_a_bad_upload_is_refused_naming_the_site_and_the_others_are_kept(federation, tmp_path, breakage, reason):
    uploads = _copy_uploads(federation, tmp_path / "in")
    doc = json.loads(uploads["C3"].read_text())
    breakage(doc)
    uploads["C3"].write_text(json.dumps(doc))
    before = {s: p.read_bytes() for s, p in uploads.items()}
    with pytest.raises(UploadsRefused) as err:
        check_uploads(list(uploads.values()), federation["cfg"], tmp_path / "out")
    assert list(err.value.refusals) == ["C3"] and reason in err.value.refusals["C3"]
    assert err.value.refusals["C3"].startswith("site C3: upload refused")
    refused = json.loads((tmp_path / "out" / "refused.json").read_text())
    assert refused["accepted"] == ["C1", "C2", "C4", "C5"] and list(refused["refused"]) == ["C3"]
    assert {s: p.read_bytes() for s, p in uploads.items()} == before  # nothing of any site's work is touched
    assert not (tmp_path / "out" / "descriptors.json").exists()


def test_an_unparseable_or_missing_upload_is_refused_by_name(federation, tmp_path):
    uploads = _copy_uploads(federation, tmp_path / "in")
    uploads["C2"].write_text("{not json")
    with pytest.raises(UploadsRefused) as err:
        check_uploads([p for s, p in uploads.items() if s != "C5"], federation["cfg"], tmp_path / "out")
    assert set(err.value.refusals) == {"C2", "C5"}
    assert "not readable JSON" in err.value.refusals["C2"] and "no upload" in err.value.refusals["C5"]


def test_an_undecodable_image_stops_the_site_naming_the_file(federation, tmp_path):
    site = tmp_path / "site9"
    shutil.copytree(federation["folders"]["C1"], site)
    victim = sorted(site.rglob("*.jpeg"))[2]
    victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])  # truncated: header still parses
    with pytest.raises(OSError, match=str(victim)):
        prepare_site(site, "C1", tmp_path / "out", federation["cfg"])
    assert not (tmp_path / "out" / "upload.json").exists()


def test_a_drop_list_for_another_site_is_refused(federation, tmp_path):
    drops = tmp_path / "drops.csv"
    drops.write_text("sample_id\n0123456789abcdef\n")
    with pytest.raises(RuntimeError, match="does not hold"):
        prepare_site(federation["folders"]["C2"], "C2", tmp_path / "out", federation["cfg"], exclude=drops)


def test_an_evaluation_site_uploads_hashes_and_counts_but_no_descriptor(federation, tmp_path):
    up = prepare_site(federation["folders"]["C5"], "EXT", tmp_path / "ext", federation["cfg"], role="external")
    assert up.descriptor is None and up.site_index is None
    assert up.class_counts == {"external": {"ACA": 5, "Normal": 6, "SCC": 0}}  # the re-encoded copy is a family
    rows = _read(tmp_path / "ext" / "manifest" / "manifest.csv")
    assert {(r["partition"], r["split"], r["client"], r["cohort"]) for r in rows} == {("external", "external", "", "external")}


# ------------------------------------------------------------------ code identity
def test_code_identity_names_version_commit_and_a_digest_of_the_package():
    ident = code_identity()
    assert set(ident) == {"package_version", "git_commit", "source_digest"}
    assert len(ident["source_digest"]) == 64
    assert ident["git_commit"] is None or len(ident["git_commit"].split("+")[0]) == 40


def test_source_digest_is_the_same_for_a_copy_and_differs_after_an_edit(tmp_path):
    import fedhisto

    src = Path(fedhisto.__file__).resolve().parent
    copy = tmp_path / "fedhisto"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "stray.pyc").write_bytes(b"not source")
    assert source_digest(copy) == source_digest()  # a wheel's files, no git: same digest
    with (copy / "metrics" / "stage.py").open("a") as fh:
        fh.write("\n# a site's local edit\n")
    assert source_digest(copy) != source_digest()
    edited = {**code_identity(), "source_digest": source_digest(copy), "git_commit": None}
    with pytest.raises(CodeMismatch, match="site C4 runs other code"):
        check_code("site C4", edited)
    check_code("site C4", {**code_identity(), "git_commit": None})  # no commit (a wheel) is no reason to refuse
    check_code("site C4", identity_strings())  # as a ConfigRecord carries it
    assert set(identity_strings().values()) <= {v if v is not None else "" for v in code_identity().values()}
    with pytest.raises(CodeMismatch, match="no code identity"):
        check_code("site C4", "0.1.0")


def test_open_audit_sees_image_reads():
    """The audit this module relies on records an image decode (so an empty list means something)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.png"
        Image.new("RGB", (4, 4)).save(p)
        _OPENED.clear()
        _RECORDING[0] = True
        try:
            from fedhisto.infra.imageio import load_rgb

            load_rgb(p)
        finally:
            _RECORDING[0] = False
        assert os.path.realpath(p) in _OPENED


# ------------------------------------------------------------------ command line
def test_cli_two_word_spellings_reach_the_site_local_commands(capsys):
    from fedhisto.cli import main

    for argv, prog in ((["site", "prepare", "--help"], "site-prepare"), (["federation", "check-uploads", "--help"],
                                                                         "check-uploads")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0 and f"fedhisto {prog}" in capsys.readouterr().out


def test_cli_check_uploads_exits_2_naming_the_refused_site(federation, tmp_path, capsys):
    from fedhisto.cli import main

    uploads = _copy_uploads(federation, tmp_path / "in")
    doc = json.loads(uploads["C4"].read_text())
    doc["descriptor"]["raw"] = "abc"
    uploads["C4"].write_text(json.dumps(doc))
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(federation["cfg"].model_dump(mode="json")))  # YAML reads JSON
    rc = main(["check-uploads", *map(str, uploads.values()), "--config", str(config), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "C4: site C4: upload refused: descriptor.raw must hold 14 numbers" in err
    ok = main(["check-uploads", *(str(federation["uploads"][s]) for s in SITES), "--config", str(config),
               "--out", str(tmp_path / "ok")])
    check = json.loads((tmp_path / "ok" / "check.json").read_text())
    assert ok == 0 and check["duplicates"]["unresolved_components"] == 0 and len(check["dataset_identity"]) == 64


def test_site_workflow_is_lint_clean_and_needs_site_and_images(repo, snakemake_bin, federation):
    import subprocess

    snakefile = str(repo / "workflow/site/Snakefile")
    lint = subprocess.run([snakemake_bin, "-s", snakefile, "--lint", "--config", "site=C2",
                           f"images={federation['folders']['C2']}"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert_lint_clean(lint)
    dry = subprocess.run([snakemake_bin, "-s", snakefile, "-n", "--config", "site=C2",
                          f"images={federation['folders']['C2']}"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0 and "results/site/C2/upload.json" in dry.stdout, dry.stdout + dry.stderr
    from fedhisto.federation.prepare import folder_inventory

    before = folder_inventory(federation["folders"]["C2"])
    assert before == folder_inventory(federation["folders"]["C2"]) and len(before) == 64
    missing = subprocess.run([snakemake_bin, "-s", snakefile, "-n"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "--config site=" in missing.stdout + missing.stderr


def test_a_site_states_its_code_identity_in_the_handshake(federation):
    """The ClientApp's ``query`` reply (and every ``train`` reply) carries ``code_identity`` as strings,
    which ``check_code`` on the coordinator accepts; the server-side refusal is wired by the round driver."""
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedhisto.federation.client_app import app

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    raw = federation["cfg"].model_dump(mode="json")
    raw["model"].update(encoder={"name": "tiny", "require_pretrained": False}, adapter_hidden=16, film_hidden=16)
    raw["views"]["crop_size"] = 48
    run = {"method": "fedavg_peft", "seed": 11, "config": json.dumps(raw), "site": "", "round": -1, "k": -1}
    msg = Message(RecordDict({"run": ConfigRecord(run)}), dst_node_id=1, message_type="query")
    msg.metadata.__dict__["_message_id"] = "m1"
    node = {"site-id": "C2", "manifest": str(federation["tmp"] / "prepared" / "C2" / "manifest" / "manifest.csv")}
    reply = app(msg, Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={}))
    assert "error" not in reply.content, dict(reply.content["error"])
    assert dict(reply.content["code"]) == identity_strings()
    check_code("site C2", dict(reply.content["code"]))


def test_folder_inventory_changes_when_an_image_deep_inside_changes(tmp_path):
    from fedhisto.federation.prepare import folder_inventory

    img = tmp_path / "site" / "ACA" / "a.png"
    img.parent.mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(img)
    first = folder_inventory(tmp_path / "site")
    Image.new("RGB", (5, 4)).save(tmp_path / "site" / "ACA" / "b.png")
    assert folder_inventory(tmp_path / "site") != first
    assert folder_inventory(tmp_path / "nowhere") == "missing"
