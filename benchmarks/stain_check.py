"""Cross-check fedhisto's Macenko stain directions against torchstain on real images.

Usage: ``python benchmarks/stain_check.py [--shared ../shared]``. Installs torchstain with
``--no-deps`` into ``.bench/`` (its numpy backend needs nothing else). Prints, per image, the
cosine between fedhisto's and torchstain's hematoxylin and eosin directions and fedhisto's
H&E plausibility check; the IHC control must come out flagged, not silently accepted.
Skips cleanly when the shared folder is absent.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedhisto.config.study import StainConfig
from fedhisto.infra.imageio import load_rgb
from fedhisto.stain.stage import he_check, macenko_directions, optical_density, tissue_mask

REPO = Path(__file__).resolve().parents[1]


def torchstain_directions(rgb: np.ndarray) -> np.ndarray:
    target = REPO / ".bench" / "torchstain"
    if not (target / "torchstain").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        "torchstain==1.4.1"], check=True)
    sys.path.insert(0, str(target))
    from torchstain.numpy.normalizers.macenko import NumpyMacenkoNormalizer

    norm = NumpyMacenkoNormalizer()
    norm.fit(rgb, Io=240, alpha=1, beta=0.15)
    he = norm.HERef
    return np.stack([he[:, i] * np.sign(he[:, i].sum()) / np.linalg.norm(he[:, i]) for i in range(2)], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shared", default=str(REPO.parent / "shared"))
    args = parser.parse_args()
    root = Path(args.shared) / "realdata"
    if not root.exists():
        print(f"skipped: {root} not found")
        return
    cfg = StainConfig()
    images = [root / "he-tile/tiatoolbox_target_image.png", *sorted((root / "lc25000-sample").rglob("*.jpeg")),
              root / "controls/skimage_ihc_not_he.png"]
    worst = 1.0
    print(f"{'image':40s} {'cos H':>7s} {'cos E':>7s}  H&E check (cos to reference H, E)")
    for path in images:
        rgb = load_rgb(path)
        od = optical_density(rgb, cfg.od_reference_intensity)
        ours = macenko_directions(od[tissue_mask(od, cfg.od_background)], cfg.percentile)
        theirs = torchstain_directions(rgb)
        cos = [float(ours[:, i] @ theirs[:, i]) for i in range(2)]
        check = he_check(ours, cfg.he_min_cosine)
        if "controls" not in str(path):
            worst = min(worst, *cos)
        flag = "H&E-like" if check["he_like"] else "FLAGGED: not H&E-like"
        print(f"{path.relative_to(root).as_posix()[-40:]:40s} {cos[0]:7.4f} {cos[1]:7.4f}  {flag} "
              f"({check['cos_hematoxylin']:.3f}, {check['cos_eosin']:.3f})")
    print(f"minimum direction cosine vs torchstain on H&E images: {worst:.6f} (target >= 0.99)")


if __name__ == "__main__":
    main()
