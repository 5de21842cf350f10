"""``fedhisto classify``'s domain check: is an image, and is the folder, inside what the model saw?

From the package's domain statistics (:mod:`fedhisto.export.domain_stats`; no training image is in a
package):

- per image, ``ood_score``: the Mahalanobis distance of its adapted embedding to the nearest training class
  (mean over members); ``in_domain`` is ``no`` when the score exceeds the conformal threshold of the
  training sites' holdout scores at ``--false-flag-rate`` (default 5 %): an in-domain image is flagged with
  probability at most the stated bound (for images exchangeable with the calibration holdouts; the JSON also
  gives the rate seen on each training site's holdout against the other sites' threshold);
- the folder, by two independent lines: (1) more flagged images than in-domain images give, a one-sided
  binomial test at the stated bound (p < ``FOLDER_P``); (2) the folder's stain descriptor (the stain
  stage's estimator) farther from the training sites (Ledoit-Wolf Mahalanobis) than any same-size
  resample of a training site's own images strayed, with the dimensions beyond their own limits, in
  training SD units. Either line puts the folder outside what the model saw; the JSON and the log say so
  in one line.
"""

from __future__ import annotations

import numpy as np

from fedhisto.export.domain_stats import (
    RELATIVE_TOLERANCE,
    conformal_threshold,
    descriptor_distance,
    leave_one_site_out,
    limit_for,
    mahalanobis_scores,
)

FOLDER_P = 0.001  # [ours] a folder is "outside" when in-domain images would flag this many with p below this


def image_scores(domain: dict[str, dict[str, np.ndarray]], feats: dict[str, np.ndarray]) -> np.ndarray:
    missing = sorted(set(feats) - set(domain))
    if missing:
        raise ValueError(f"package members {missing} carry no domain statistics")
    return np.mean([mahalanobis_scores(z, domain[m]) for m, z in feats.items()], axis=0)


def in_domain(scores: np.ndarray, threshold: float) -> np.ndarray:
    return scores <= threshold * (1 + RELATIVE_TOLERANCE)


def embedding_verdict(scores: np.ndarray, calibration: list[float], rate: float) -> dict:
    from scipy.stats import binom

    thr = conformal_threshold(calibration, rate)
    flagged = int((~in_domain(scores, thr["threshold"])).sum())
    n = len(scores)
    p = float(binom.sf(flagged - 1, n, thr["bound"])) if flagged else 1.0
    return {"threshold": thr, "flagged": flagged, "images": n, "expected_at_most": round(n * thr["bound"], 2),
            "binomial_p": p, "outside": p < FOLDER_P}


def descriptor_verdict(z: np.ndarray | None, info: dict, block: dict) -> dict:
    """``z``: the folder's standardised descriptor (None when the estimator fell back)."""
    if z is None:
        return {"available": False, "reason": info.get("fallback", "no descriptor"), "outside": False}
    z = np.asarray(z, dtype=np.float64)
    names = block["names"]
    out = {"available": True, "images": info["images"], "standardised": [round(float(v), 4) for v in z],
           "mahalanobis": round(descriptor_distance(z, block["reference"]), 4)}
    if not block.get("limits"):
        return {**out, "outside": False, "reason": "the package carries no descriptor limits"}
    size, dist_limit, dim_limit = limit_for(block["limits"], info["images"])
    if dist_limit is None:  # every resample of that size fell back (too little tissue): nothing to judge by
        return {**out, "outside": False, "reason": f"no in-domain limit for {size} image(s)"}
    beyond = [{"dimension": n, "sd": round(float(v), 2), "limit": round(float(lim), 2)}
              for n, v, lim in zip(names, z, dim_limit, strict=True) if abs(v) > lim]
    return {**out, "judged_at_size": size, "mahalanobis_limit": round(dist_limit, 4), "beyond": beyond,
            "outside": out["mahalanobis"] > dist_limit}


def folder_line(emb: dict | None, desc: dict) -> tuple[str, str]:
    """(verdict, the one line the log and the JSON carry)."""
    if emb is None:
        return "unknown", ("domain check unavailable: the package carries no domain statistics (exported by an "
                           "older fedhisto); export it again")
    parts = [f"{emb['flagged']} of {emb['images']} image(s) out of domain (in-domain images give at most "
             f"{emb['expected_at_most']:g} at the {emb['threshold']['bound']:.1%} false-flag bound; p = "
             f"{emb['binomial_p']:.2g})"]
    if desc["available"] and "mahalanobis_limit" in desc:
        dims = ", ".join(f"{b['dimension']} {b['sd']:+.1f} SD" for b in desc["beyond"][:4])
        parts.append(f"stain descriptor at Mahalanobis {desc['mahalanobis']:.1f} from the training sites "
                     f"(limit {desc['mahalanobis_limit']:.1f} for {desc['judged_at_size']}+ images)"
                     + (f"; beyond the training range: {dims}" if dims else ""))
    elif desc.get("reason"):
        parts.append(f"stain descriptor not judged ({desc['reason']})")
    outside = emb["outside"] or desc.get("outside", False)
    verdict = "outside" if outside else "within"
    head = "the folder is OUTSIDE what the model saw" if outside else "the folder is within what the model saw"
    return verdict, f"{head}: " + "; ".join(parts)


def check_domain(pkg, feats: dict[str, np.ndarray] | None, folder_z: np.ndarray | None, folder_info: dict,
                 rate: float) -> tuple[np.ndarray | None, np.ndarray | None, dict]:
    """(per-image scores, per-image in-domain flags, the summary's ``domain`` block); scores and flags are
    None for a package without domain statistics."""
    block = pkg.meta.get("domain")
    if not block or not pkg.domain or feats is None:
        verdict, line = folder_line(None, {})
        return None, None, {"verdict": verdict, "line": line}
    scores = image_scores(pkg.domain, feats)
    by_site = block["embedding"]["calibration"]["scores"]
    calibration = [s for v in by_site.values() for s in v]
    emb = embedding_verdict(scores, calibration, rate)
    emb["leave_one_site_out"] = leave_one_site_out(by_site, rate)
    desc = descriptor_verdict(folder_z, folder_info, block["descriptor"])
    verdict, line = folder_line(emb, desc)
    return scores, in_domain(scores, emb["threshold"]["threshold"]), {
        "verdict": verdict, "line": line, "false_flag_rate": rate, "embedding": emb, "descriptor": desc,
        "calibration_images": len(calibration)}
