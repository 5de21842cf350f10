"""Clearance benchmark: quality on real LC25000 families, imagededup's PHash side by side, and speed.

Usage::

    python benchmarks/clearance_benchmark.py [--shared ../shared] [--sizes 1000 3000] [--threads 2]

1. Real images (``<shared>/realdata/lc25000-sample`` with curated family labels in MANIFEST.tsv):
   pairwise precision / recall / F1 and ARI per class, class-mixing check, images per second,
   for fedhisto and for imagededup's PHash (Hamming <= 10, families = connected components).
   Skipped cleanly when the shared folder is absent.
2. Speed at scale on LC25000-shaped synthetic corpora (families of 20: an original and 19
   copies rotated by up to 25 degrees with crop-and-zoom and random flips, 224 px JPEG), so
   cost per 1,000 images and its growth can be read off, with pairwise F1 against the truth.

imagededup is not a project dependency: its package imports torchvision at import time, which
cannot be installed beside the CPU torch build, so this script installs it with ``--no-deps``
into ``.bench/`` and stubs its CNN and model modules (PHash needs numpy, scipy, PIL and PyWavelets only).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
from PIL import Image

from fedhisto.clearance.engine import audit_images
from fedhisto.clearance.families import components, pairwise_scores
from fedhisto.config import ClearanceConfig
from fedhisto.synth.families import encode_jpeg, rotate_zoom
from fedhisto.synth.stain import SITE_STYLES, render_rgb
from fedhisto.synth.tissue import tissue

REPO = Path(__file__).resolve().parents[1]
CLASSES = {"lung_aca": "ACA", "lung_n": "Normal", "lung_scc": "SCC"}


def imagededup_phash():
    target = REPO / ".bench" / "imagededup"
    if not (target / "imagededup").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        "imagededup==0.3.3.post2"], check=True)
    sys.path.insert(0, str(target))
    for name, attr in (("imagededup.methods.cnn", "CNN"), ("imagededup.utils.models", "CustomModel")):
        stub = types.ModuleType(name)  # the torch/torchvision parts PHash never touches
        setattr(stub, attr, None)
        sys.modules[name] = stub
    from imagededup.methods import PHash

    return PHash(verbose=False)


def families_from(result_families, n) -> list[str]:
    label = {}
    for k, fam in enumerate(result_families):
        for i in fam:
            label[i] = str(k)
    return [label.get(i, f"s{i}") for i in range(n)]


def score_by_class(truth: list[str], found: list[str], classes: list[str]) -> dict:
    out = {}
    for cls in sorted(set(classes)):
        idx = [i for i, c in enumerate(classes) if c == cls]
        out[cls] = pairwise_scores([truth[i] for i in idx], [found[i] for i in idx])
    return out


def real_benchmark(shared: Path, threads: int) -> None:
    root = shared / "realdata"
    manifest = root / "MANIFEST.tsv"
    if not manifest.exists():
        print(f"[real] skipped: {manifest} not found")
        return
    rows = [r for r in csv.DictReader(manifest.open(), delimiter="\t") if r["path"].startswith("lc25000-sample/")]
    paths = [str(root / r["path"]) for r in rows]
    truth = [r["family"] for r in rows]
    classes = [CLASSES[r["label"]] for r in rows]
    t0 = time.perf_counter()
    res = audit_images(paths, ClearanceConfig(), threads=threads, progress=False)
    secs = time.perf_counter() - t0
    found = families_from(res.families, len(paths))
    mixed = [f for f in res.families if len({classes[i] for i in f}) > 1]
    print(f"[real] {len(paths)} LC25000 images, {len(set(truth))} curated families")
    print(f"[real] fedhisto: {len(paths) / secs:.1f} images/s ({secs:.1f} s, {threads} threads); "
          f"families mixing two classes: {len(mixed)}")
    for cls, s in score_by_class(truth, found, classes).items():
        print(f"[real]   fedhisto {cls:6s} precision {s['precision']:.4f} recall {s['recall']:.4f} "
              f"F1 {s['f1']:.4f} ARI {s['ari']:.4f}")
    try:
        phash = imagededup_phash()
    except Exception as exc:  # offline or incompatible: say so, keep the fedhisto figures
        print(f"[real] imagededup unavailable: {exc}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(paths):  # flat folder, unique names
            (Path(tmp) / f"{i:04d}{Path(p).suffix}").symlink_to(p)
        t0 = time.perf_counter()
        dups = phash.find_duplicates(image_dir=tmp, max_distance_threshold=10)
        secs = time.perf_counter() - t0
    edges = [(int(Path(a).stem), int(Path(b).stem)) for a, bs in dups.items() for b in bs]
    found_p = families_from(components(len(paths), edges), len(paths))
    print(f"[real] imagededup PHash (Hamming <= 10): {len(paths) / secs:.1f} images/s")
    for cls, s in score_by_class(truth, found_p, classes).items():
        print(f"[real]   imagededup {cls:6s} precision {s['precision']:.4f} recall {s['recall']:.4f} "
              f"F1 {s['f1']:.4f} ARI {s['ari']:.4f}")


def lc25000_like_corpus(folder: Path, n_images: int, family_size: int = 20, seed: int = 0) -> tuple[list[str], list[str]]:
    """Originals rendered at 224 px (three classes, five sites), each with rotated/flipped/zoomed copies."""
    rng = np.random.default_rng(seed)
    paths, truth = [], []
    sites = [s for s in SITE_STYLES if s != "external"]
    for fam in range(n_images // family_size):
        label = ("ACA", "Normal", "SCC")[fam % 3]
        h, e = tissue(label, rng, 224, 224 / 128)
        original = Image.fromarray(render_rgb(h, e, SITE_STYLES[sites[fam % len(sites)]].jittered(rng), rng, 1.75))
        for m in range(family_size):
            img = original if m == 0 else rotate_zoom(original, float(rng.uniform(-25, 25)))
            if m and rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            if m and rng.random() < 0.3:
                img = img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
            p = folder / f"{fam:05d}_{m:02d}.jpeg"
            p.write_bytes(encode_jpeg(img, 90))
            paths.append(str(p))
            truth.append(str(fam))
    order = rng.permutation(len(paths))
    return [paths[i] for i in order], [truth[i] for i in order]


def scale_benchmark(sizes: list[int], threads: int) -> None:
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            paths, truth = lc25000_like_corpus(Path(tmp), n)
            t0 = time.perf_counter()
            res = audit_images(paths, ClearanceConfig(), threads=threads, progress=False)
            secs = time.perf_counter() - t0
            s = pairwise_scores(truth, families_from(res.families, len(paths)))
            st = res.stats["seconds"]
            print(f"[scale] {len(paths):6d} images: {secs:7.1f} s = {1000 * secs / len(paths):5.1f} s per 1,000 "
                  f"(fingerprint {st['fingerprint']} s, candidates {st['candidates']} s, verify {st['verify']} s; "
                  f"{res.stats['verified']} verified, {res.stats['implied']} implied); "
                  f"pairwise P {s['precision']:.4f} R {s['recall']:.4f} F1 {s['f1']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", default=str(REPO.parent / "shared"))
    parser.add_argument("--sizes", type=int, nargs="*", default=[1000, 3000])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    real_benchmark(Path(args.shared), args.threads)
    scale_benchmark(args.sizes, args.threads)


if __name__ == "__main__":
    main()
