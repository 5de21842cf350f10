"""Clearance benchmark: quality on real LC25000 families, imagededup's PHash side by side, and speed.

Usage::

    python benchmarks/clearance_benchmark.py [--shared ../shared] [--sizes 1000 3000] [--threads 2]
        [--links off 6x2 ...] [--corpora sample degraded real-families planted] [--degrade 80:50 ...]
        [--zoom off 1.6 ...] [--zoom-corpora sample distractors isolated] [--distractors 1000]
        [--skip-real] [--skip-imagededup]

1. Real images (``<shared>/realdata/lc25000-sample`` with curated family labels in MANIFEST.tsv):
   pairwise precision / recall / F1 and ARI per class, class-mixing check, images per second,
   for fedhisto and for imagededup's PHash (Hamming <= 10, families = connected components).
   Skipped cleanly when the shared folder is absent.
2. Speed at scale on LC25000-shaped synthetic corpora (families of 20: an original and 19
   copies rotated by up to 25 degrees with crop-and-zoom and random flips, 224 px JPEG), so
   cost per 1,000 images and its growth can be read off, with pairwise F1 against the truth.

3. The second pass (``clearance.link_min_inliers`` x ``link_min_pairs``, written ``6x2``; ``off``
   is the first pass alone) side by side on every corpus: pairwise precision / recall, true
   families split over two or more detected families, detected families merging two true ones,
   links made. ``--corpora``: the real sample as it is (``sample``) and degraded (``degraded``,
   sizes from ``--degrade SIZE:QUALITY``: downscaled and re-encoded, which makes the first pass
   split families); LC25000-shaped families of real tiles (``real-families``: the WSSS4LUAD,
   tiatoolbox and 768 px LC25000 images of the shared folder plus one image per LC25000 sample
   family, each given 19 rotated / zoomed / flipped copies); the embedded default's planted
   families (``planted``: its synthetic cohort rendered into a temporary folder); and the
   ``--sizes`` synthetic LC25000-shaped corpora.

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
from fedhisto.cohort.stage import run_cohort
from fedhisto.config.study import ClearanceConfig, CohortConfig
from fedhisto.realdata.sources import read_sources_csv
from fedhisto.synth.relatives import encode_jpeg, rotate_zoom
from fedhisto.synth.stain_styles import SITE_STYLES, render_rgb
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


def parse_link(spec: str) -> tuple[int | None, int]:
    """``off`` (first pass only) or ``<link_min_inliers>x<link_min_pairs>``, e.g. ``6x2``."""
    if spec == "off":
        return None, 2
    inliers, _, pairs = spec.partition("x")
    return int(inliers), int(pairs or 2)


def split_and_merged(truth: list[str], found: list[str]) -> tuple[int, int, int]:
    """(true families of 2+ split over 2+ detected families, how many such families, detected
    families of 2+ holding members of 2+ true families)."""
    by_truth: dict[str, set[str]] = {}
    by_found: dict[str, set[str]] = {}
    for t, f in zip(truth, found, strict=True):
        by_truth.setdefault(t, set()).add(f)
        by_found.setdefault(f, set()).add(t)
    sizes = {t: truth.count(t) for t in by_truth}
    split = sum(1 for t, fs in by_truth.items() if sizes[t] > 1 and len(fs) > 1)
    merged = sum(1 for ts in by_found.values() if len(ts) > 1)
    return split, sum(1 for t in by_truth if sizes[t] > 1), merged


def compare_links(label: str, paths: list[str], truth: list[str], links: list[str], threads: int) -> None:
    """First pass alone and each second-pass setting on one corpus."""
    print(f"[{label}] {len(paths)} images, {len(set(truth))} true families (singletons included)")
    for spec in links:
        link_min_inliers, link_min_pairs = parse_link(spec)
        cfg = ClearanceConfig(link_min_inliers=link_min_inliers, link_min_pairs=link_min_pairs)
        t0 = time.perf_counter()
        res = audit_images(paths, cfg, threads=threads, progress=False)
        secs = time.perf_counter() - t0
        found = families_from(res.families, len(paths))
        s = pairwise_scores(truth, found)
        split, families, merged = split_and_merged(truth, found)
        link_s = res.stats["seconds"].get("link", 0.0)
        print(f"[{label}] {spec:>5s}: pairwise P {s['precision']:.4f} R {s['recall']:.4f} F1 {s['f1']:.4f}; "
              f"families split {split} / {families}, merged {merged}; links {res.stats.get('family_links', 0)} "
              f"({s['found_pairs']} found / {s['true_pairs']} true pairs; {secs:.1f} s, second pass {link_s} s)")


def lc25000_rows(shared: Path) -> list[dict]:
    manifest = shared / "realdata" / "MANIFEST.tsv"
    return [r for r in csv.DictReader(manifest.open(), delimiter="\t") if r["path"].startswith("lc25000-sample/")]


def degraded_copies(paths: list[str], folder: Path, size: int, quality: int) -> list[str]:
    """The same images downscaled to ``size`` px and re-encoded at JPEG ``quality``."""
    out = []
    for i, p in enumerate(paths):
        img = Image.open(p).convert("RGB").resize((size, size), Image.Resampling.LANCZOS)
        target = folder / f"{i:04d}.jpeg"
        target.write_bytes(encode_jpeg(img, quality))
        out.append(str(target))
    return out


def real_originals(shared: Path) -> list[Image.Image]:
    """Distinct real tissue pictures: WSSS4LUAD tiles, nine crops of the 1000 px tiatoolbox tile,
    one 768 px LC25000 original, and the first image of each LC25000 sample family."""
    root = shared / "realdata"
    pics = [Image.open(p).convert("RGB") for p in sorted((root / "wsss4luad-sample").glob("luad_*_img*/*"))
            + sorted((root / "wsss4luad-sample" / "luad_training_examples").glob("*"))]
    tile = Image.open(root / "he-tile" / "tiatoolbox_target_image.png").convert("RGB")
    step = tile.width // 3
    pics += [tile.crop((x, y, x + step, y + step)) for y in range(0, 3 * step, step) for x in range(0, 3 * step, step)]
    pics.append(Image.open(root / "lc25000-originals-768" / "lung_aca-lungaca1__GeorgeBatch.jpeg").convert("RGB"))
    first: dict[str, str] = {}
    for r in lc25000_rows(shared):
        first.setdefault(r["family"], r["path"])
    pics += [Image.open(root / p).convert("RGB") for p in first.values()]
    return [p.crop((0, 0, min(p.size), min(p.size))) for p in pics]


def augmentation_families(originals: list[Image.Image], folder: Path, family_size: int = 20,
                          seed: int = 0) -> tuple[list[str], list[str]]:
    """LC25000's recipe on real pictures: rotation up to 25 degrees with zoom, random flips, 224 px JPEG."""
    rng = np.random.default_rng(seed)
    paths, truth = [], []
    for fam, original in enumerate(originals):
        base = original.resize((448, 448), Image.Resampling.LANCZOS)
        for m in range(family_size):
            img = base if m == 0 else rotate_zoom(base, float(rng.uniform(-25, 25)))
            if m and rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            if m and rng.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
            p = folder / f"{fam:03d}_{m:02d}.jpeg"
            p.write_bytes(encode_jpeg(img.resize((224, 224), Image.Resampling.LANCZOS), 90))
            paths.append(str(p))
            truth.append(str(fam))
    order = rng.permutation(len(paths))
    return [paths[i] for i in order], [truth[i] for i in order]


def link_benchmark(shared: Path, links: list[str], corpora: list[str], degrade: list[str], threads: int) -> None:
    if not (shared / "realdata" / "MANIFEST.tsv").exists():
        print("[link] real corpora skipped: no realdata folder")
        return
    rows = lc25000_rows(shared)
    paths = [str(shared / "realdata" / r["path"]) for r in rows]
    truth = [r["family"] for r in rows]
    if "sample" in corpora:
        compare_links("real 224px", paths, truth, links, threads)
    for spec in degrade if "degraded" in corpora else []:
        size, quality = (int(v) for v in spec.split(":"))
        with tempfile.TemporaryDirectory() as tmp:
            compare_links(f"real {size}px q{quality}", degraded_copies(paths, Path(tmp), size, quality), truth,
                          links, threads)
    if "real-families" in corpora:
        with tempfile.TemporaryDirectory() as tmp:
            originals = real_originals(shared)
            fam_paths, fam_truth = augmentation_families(originals, Path(tmp))
            compare_links(f"real-tile families ({len(originals)} x 20)", fam_paths, fam_truth, links, threads)


def parse_zoom(spec: str) -> list[float]:
    """``off`` (no zoom views) or comma-separated factors, e.g. ``1.6`` or ``1.4,1.9``."""
    return [] if spec == "off" else [float(z) for z in spec.split(",")]


def zoom_isolated(paths: list[str], truth: list[str], near: float = 1.35) -> tuple[list[int], list[int]]:
    """Indices of a sub-sample where one member per family has only relatives at another zoom: per
    family, the member with the most relatives that verify (>= 10 inliers) at a scale ratio beyond
    ``near``; its relatives within ``near`` of its own scale are left out. Returns (kept, isolated)."""
    from fedhisto.clearance.verify import extract, make_detector, verify
    from fedhisto.infra.imageio import load_rgb

    det, norm = make_detector("sift", 400)
    feats = [extract(load_rgb(p), det) for p in paths]
    drop, isolated = set(), []
    for fam in sorted(set(truth)):
        members = [i for i, t in enumerate(truth) if t == fam]
        best = None
        for a in members:
            verdicts = {b: verify(feats[a], feats[b], norm, 0.75, 10) for b in members if b != a}
            near_ones = {b for b, v in verdicts.items() if v.inliers >= 5 and 1 / near < v.scale < near}
            far = [b for b, v in verdicts.items() if b not in near_ones and v.confirmed(10)]
            if len(far) >= 2 and (best is None or len(far) > best[0]):
                best = (len(far), a, near_ones)
        if best:
            isolated.append(best[1])
            drop |= best[2]
    return [i for i in range(len(paths)) if i not in drop], isolated


def zoom_benchmark(shared: Path, zooms: list[str], distractors: int, threads: int,
                   which: tuple[str, ...] = ("sample", "distractors", "isolated")) -> None:
    """The real LC25000 sample alone, then among distractors: synthetic LC25000-shaped families
    (``distractors`` images) and LC25000-recipe families of the shared folder's non-LC25000 real pictures
    (19 x 20). Per ``clearance.zoom_views`` setting: pairwise precision / recall over the whole corpus,
    the sample's true pairs proposed as candidates, families split / merged, time and candidate counts."""
    if "planted" in which:  # the embedded default's synthetic cohort: what turning zoom views on would change
        with tempfile.TemporaryDirectory() as tmp:
            run_cohort(CohortConfig(), tmp, threads=threads)
            srows = read_sources_csv(Path(tmp) / "sources.csv")
            planted = {r["relpath"]: r["family"] for r in csv.DictReader((Path(tmp) / "planted_families.csv").open())}
            truth = [f"planted-{planted[r.relpath]}" if r.relpath in planted else f"single-{r.relpath}" for r in srows]
            first = None
            for spec in zooms:
                res = audit_images([r.path for r in srows], ClearanceConfig(zoom_views=parse_zoom(spec)),
                                   threads=threads, progress=False)
                found = families_from(res.families, len(srows))
                s = pairwise_scores(truth, found)
                split, families, merged = split_and_merged(truth, found)
                print(f"[zoom] planted (embedded default) zoom {spec:>7s}: pairwise P {s['precision']:.4f} "
                      f"R {s['recall']:.4f}; split {split} / {families}, merged {merged}; candidates "
                      f"{res.stats['candidates']}, zoom-only {res.stats.get('zoom_pairs', 0)}, confirmed by stage "
                      f"{res.stats['confirmed_by_stage']}")
                members = {srows[i].relpath: frozenset(srows[j].relpath for j in f) for f in res.families for i in f}
                if first is None:
                    first = members
                else:  # images whose family differs from the first setting's
                    moved = sorted(r for r in members if members[r] != first[r])
                    print(f"[zoom] planted (embedded default) zoom {spec}: images whose family changed: {moved}")
    if not (shared / "realdata" / "MANIFEST.tsv").exists():
        print("[zoom] skipped: no realdata folder")
        return
    rows = lc25000_rows(shared)
    sample = [str(shared / "realdata" / r["path"]) for r in rows]
    sample_truth = [r["family"] for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "syn").mkdir()
        (Path(tmp) / "real").mkdir()
        syn_paths, syn_truth = lc25000_like_corpus(Path(tmp) / "syn", distractors)
        pics = real_originals(shared)[:19]  # WSSS4LUAD tiles and tiatoolbox crops: no LC25000 picture
        real_paths, real_truth = augmentation_families(pics, Path(tmp) / "real")
        kept, isolated = zoom_isolated(sample, sample_truth)
        lone = [sample[i] for i in isolated]
        rest = [sample[i] for i in kept if i not in isolated]
        others = syn_paths + real_paths
        other_truth = [f"syn-{t}" for t in syn_truth] + [f"tile-{t}" for t in real_truth]
        corpora = [("real sample", sample, sample_truth),
                   (f"real sample + {len(others)} distractors", sample + others, sample_truth + other_truth),
                   (f"zoom-isolated real sample ({len(lone)} of {len(kept)} images with relatives only at another "
                    f"zoom) + {len(others)} distractors", lone + rest + others,
                    [sample_truth[i] for i in isolated] + [sample_truth[i] for i in kept if i not in isolated]
                    + other_truth)]
        for (label, paths, truth), name in zip(corpora, ("sample", "distractors", "isolated"), strict=True):
            if name not in which:
                continue
            n_real = len(sample) if not label.startswith("zoom-isolated") else len(kept)
            true_pairs = {(i, j) for i in range(n_real) for j in range(i + 1, n_real) if truth[i] == truth[j]}
            print(f"[zoom] {label}: {len(paths)} images, {len(true_pairs)} true pairs among the real sample")
            for spec in zooms:
                cfg = ClearanceConfig(zoom_views=parse_zoom(spec))
                t0 = time.perf_counter()
                res = audit_images(paths, cfg, threads=threads, progress=False)
                secs = time.perf_counter() - t0
                found = families_from(res.families, len(paths))
                s = pairwise_scores(truth, found)
                s_real = pairwise_scores(truth[:n_real], found[:n_real])
                split, families, merged = split_and_merged(truth, found)
                proposed = {(min(e["a"], e["b"]), max(e["a"], e["b"])) for e in res.edges if e["stage"] != "link"}
                st = res.stats
                if label.startswith("zoom-isolated"):
                    cut = [Path(paths[i]).name for i in range(len(lone))
                           if sum(found[i] == found[j] for j in range(n_real) if truth[j] == truth[i]) == 1]
                    print(f"[zoom] {label} zoom {spec}: members split from all their relatives: {len(cut)} {cut}")
                print(f"[zoom] {label} zoom {spec:>7s}: pairwise P {s['precision']:.4f} R {s['recall']:.4f} "
                      f"(real sample P {s_real['precision']:.4f} R {s_real['recall']:.4f}); "
                      f"sample true pairs proposed {len(true_pairs & proposed)} / {len(true_pairs)}; "
                      f"split {split} / {families}, merged {merged}; {secs:.1f} s ({1000 * secs / len(paths):.1f} "
                      f"ms/image; fingerprint {st['seconds']['fingerprint']} s, candidates "
                      f"{st['seconds']['candidates']} s, verify {st['seconds']['verify']} s); candidates "
                      f"{st['candidates']}, zoom-only {st.get('zoom_pairs', 0)}, verified {st['verified']}, "
                      f"confirmed by stage {st['confirmed_by_stage']}")


def planted_benchmark(links: list[str], threads: int) -> None:
    """The embedded default's synthetic cohort (originals plus planted transformed copies)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_cohort(CohortConfig(), tmp, threads=threads)
        rows = read_sources_csv(Path(tmp) / "sources.csv")
        planted = {r["relpath"]: r["family"] for r in csv.DictReader((Path(tmp) / "planted_families.csv").open())}
        truth = [f"planted-{planted[r.relpath]}" if r.relpath in planted else f"single-{r.relpath}" for r in rows]
        compare_links("planted (embedded default)", [r.path for r in rows], truth, links, threads)


def real_benchmark(shared: Path, threads: int, with_imagededup: bool = True) -> None:
    root = shared / "realdata"
    manifest = root / "MANIFEST.tsv"
    if not manifest.exists():
        print(f"[real] skipped: {manifest} not found")
        return
    rows = lc25000_rows(shared)
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
    if not with_imagededup:
        return
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


def scale_benchmark(sizes: list[int], threads: int, links: list[str] | None = None) -> None:
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            paths, truth = lc25000_like_corpus(Path(tmp), n)
            if links:  # quality of each second-pass setting on the same synthetic corpus
                compare_links(f"synthetic LC25000-shaped {n}", paths, truth, links, threads)
                continue
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
    parser.add_argument("--links", nargs="*", default=[], help="second-pass settings to compare, e.g. off 6x2 5x2")
    parser.add_argument("--corpora", nargs="*", default=["sample", "degraded", "real-families", "planted"],
                        choices=["sample", "degraded", "real-families", "planted"],
                        help="corpora the --links settings are compared on (the --sizes corpora always are)")
    parser.add_argument("--degrade", nargs="*", default=["80:50", "64:40"], help="SIZE:QUALITY of the degraded sample")
    parser.add_argument("--zoom", nargs="*", default=[],
                        help="clearance.zoom_views settings to compare on the real sample with and without "
                             "distractors, e.g. off 1.6 (off: none)")
    parser.add_argument("--distractors", type=int, default=1000, help="synthetic distractor images for --zoom")
    parser.add_argument("--zoom-corpora", nargs="*", default=["sample", "distractors", "isolated"],
                        choices=["sample", "distractors", "isolated", "planted"],
                        help="--zoom corpora: the real sample alone, among distractors, zoom-isolated among distractors")
    parser.add_argument("--skip-real", action="store_true", help="skip section 1 (real sample, imagededup)")
    parser.add_argument("--skip-imagededup", action="store_true")
    args = parser.parse_args()
    shared = Path(args.shared)
    if not args.skip_real:
        real_benchmark(shared, args.threads, with_imagededup=not args.skip_imagededup)
    if args.zoom:
        zoom_benchmark(shared, args.zoom, args.distractors, args.threads, tuple(args.zoom_corpora))
    if args.links:
        link_benchmark(shared, args.links, args.corpora, args.degrade, args.threads)
        if "planted" in args.corpora:
            planted_benchmark(args.links, args.threads)
    if args.sizes:
        scale_benchmark(args.sizes, args.threads, args.links)


if __name__ == "__main__":
    main()
