"""The clearance engine: fingerprints, candidates, verification, families, for any image list."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np

from fedhisto.clearance.candidates import (
    centre_zoom,
    global_descriptor,
    knn_cosine,
    knn_cross,
    knn_pairs,
    vocabulary,
)
from fedhisto.clearance.families import components
from fedhisto.clearance.hashing import dihedral_phashes, exact_groups, phash_pairs, sha256_of
from fedhisto.clearance.linking import link_families
from fedhisto.clearance.verify import Features, Verdict, extract, make_detector, verify
from fedhisto.config.study import ClearanceConfig
from fedhisto.infra.imageio import load_rgb
from fedhisto.infra.progress import Progress
from fedhisto.realdata.union_find import UnionFind

log = logging.getLogger(__name__)
EDGE_COLUMNS = ("a", "b", "stage", "score", "threshold", "decision", "inliers", "min_inliers", "scale",
                "angle_deg", "mirrored")

# Worker state: set in the parent before forking so children inherit it without pickling.
_STATE: dict = {}


@dataclass
class Fingerprint:
    sha256: str
    phashes: np.ndarray
    descriptor: np.ndarray
    features: Features
    size: tuple[int, int]
    #: (direct, mirrored) local descriptors of each ``clearance.zoom_views`` crop, for visual words only;
    #: SIFT's integer-valued descriptors are kept as uint8 (exact, a quarter of the memory)
    zoom_descriptors: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


def _compact(d: np.ndarray) -> np.ndarray:
    if d.dtype == np.float32 and d.size and np.all(d == np.rint(d)) and d.min() >= 0 and d.max() <= 255:
        return d.astype(np.uint8)
    return d


@dataclass
class AuditResult:
    digests: list[str]
    edges: list[dict]
    families: list[list[int]]
    stats: dict = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    #: N x V dihedral PHashes (V = 8, or 1 without dihedral invariance): a site uploads them for the
    #: coordinator's cross-site audit (federation.coordinator)
    phashes: np.ndarray | None = None


def _fingerprint(path: str) -> Fingerprint:
    cfg: ClearanceConfig = _STATE["cfg"]
    if "detector" not in _STATE:
        _STATE["detector"] = make_detector(cfg.detector, cfg.n_features)[0]
    rgb = load_rgb(path)  # raises UnreadableImageError naming the file
    zoom = []
    for z in cfg.zoom_views:
        f = extract(centre_zoom(rgb, z), _STATE["detector"])
        zoom.append((_compact(f.descriptors), _compact(f.descriptors_mirror)))
    return Fingerprint(sha256_of(path), dihedral_phashes(rgb, cfg.dihedral_invariant), global_descriptor(rgb),
                       extract(rgb, _STATE["detector"]), (rgb.shape[1], rgb.shape[0]), zoom)


def _verify_pair(pair: tuple[int, int]) -> tuple[tuple[int, int], Verdict | str]:
    cfg: ClearanceConfig = _STATE["cfg"]
    prints: list[Fingerprint] = _STATE["prints"]
    try:
        v = verify(prints[pair[0]].features, prints[pair[1]].features, _STATE["norm"], cfg.ratio_test, cfg.min_inliers)
    except Exception as exc:  # recorded as an unresolved scoring failure, never as a verdict
        return pair, f"{type(exc).__name__}: {exc}"
    return pair, v


def _pool_map(fn, items: list, threads: int, desc: str, progress: bool) -> list:
    bar = Progress(len(items), desc, "image", logger=log, bar=progress)
    out = []
    if threads <= 1 or len(items) < 64:
        for it in items:
            out.append(fn(it))
            bar.update()
    else:
        with get_context("fork").Pool(threads) as pool:
            for res in pool.imap(fn, items, chunksize=16):
                out.append(res)
                bar.update()
    bar.close()
    return out


def _proposer(pair, ph, nn, zoom, cfg) -> tuple[str, float, float]:
    """(stage, score, threshold) of the candidate source that proposed ``pair``: PHash, else the
    global-descriptor / visual-word neighbours, else the zoom views."""
    if pair in ph:
        return "phash", float(ph[pair]), cfg.phash_threshold
    if pair in nn:
        return "descriptor", nn[pair], 0
    return "zoom", zoom[pair], 0


def _verify_batches(candidates, batch, digests, uf, ph, nn, zoom, cfg, edge, failures, verify_map, bar) -> None:
    """Verify candidates most-similar first; a pair already joined by confirmed edges is 'implied'."""
    for start in range(0, len(candidates), batch):
        todo = []
        for pair in candidates[start:start + batch]:
            stage, score, threshold = _proposer(pair, ph, nn, zoom, cfg)
            if digests[pair[0]] == digests[pair[1]]:
                continue  # already an exact edge
            if uf.connected(*pair):
                edge(*pair, stage, score, threshold, "implied")
                continue
            todo.append(pair)
        for pair, verdict in verify_map(todo):
            stage, score, threshold = _proposer(pair, ph, nn, zoom, cfg)
            if isinstance(verdict, str):
                failures.append({"a": pair[0], "b": pair[1], "error": verdict})
                edge(*pair, stage, score, threshold, "failed")
                continue
            ok = verdict.confirmed(cfg.min_inliers)
            if ok:
                uf.union(*pair)
            edge(*pair, stage, score, threshold, "confirmed" if ok else "rejected", verdict)
        bar.update(min(batch, len(candidates) - start))


def _zoom_pairs(prints: list[Fingerprint], vocab, words: np.ndarray, cfg: ClearanceConfig,
                known: set[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Pairs proposed by the zoom views and by no other source: each image's words against every other
    image's zoom-view words (same vocabulary and IDF, so the other sources' candidates do not move),
    ``neighbours_per_image // 2`` per image and view, like the global descriptor's."""
    out: dict[tuple[int, int], float] = {}
    for v in range(len(cfg.zoom_views)):
        views = vocab.embed([p.zoom_descriptors[v][0] for p in prints], [p.zoom_descriptors[v][1] for p in prints])
        for pair, sim in knn_cross(words, views, max(cfg.neighbours_per_image // 2, 1)).items():
            if pair not in known:
                out[pair] = max(out.get(pair, -1.0), sim)
    return out


def audit_images(paths: list[str], cfg: ClearanceConfig, threads: int = 1, progress: bool = True) -> AuditResult:
    """Exact, perceptual and local-feature duplicate families over ``paths`` (indices into it)."""
    t0 = time.perf_counter()
    _STATE.clear()
    _STATE["cfg"] = cfg
    _STATE["norm"] = make_detector(cfg.detector, cfg.n_features)[1]
    prints: list[Fingerprint] = _pool_map(_fingerprint, paths, threads, "fingerprint", progress)
    t_fp = time.perf_counter()
    digests = [p.sha256 for p in prints]
    uf = UnionFind(len(paths))
    edges: list[dict] = []

    def edge(a: int, b: int, stage: str, score: float, threshold: float, decision: str, v: Verdict | None = None,
             min_inliers: int | None = None):
        edges.append({"a": a, "b": b, "stage": stage, "score": round(score, 6), "threshold": threshold,
                      "decision": decision, "inliers": v.inliers if v else "",
                      "min_inliers": cfg.min_inliers if min_inliers is None else min_inliers,
                      "scale": round(v.scale, 4) if v else "", "angle_deg": round(v.angle_deg, 2) if v else "",
                      "mirrored": v.mirrored if v else ""})

    exact = exact_groups(digests)
    for group in exact:
        for other in group[1:]:
            uf.union(group[0], other)
            edge(group[0], other, "exact", 1.0, 1.0, "confirmed")

    hashes = np.stack([p.phashes for p in prints]) if prints else np.zeros((0, 8), np.uint64)
    ph = {(a, b): d for a, b, d in phash_pairs(hashes, cfg.phash_threshold)}
    nn: dict[tuple[int, int], float] = {}
    zoom: dict[tuple[int, int], float] = {}
    words = np.zeros((len(prints), 1), np.float32)
    if len(prints) > 1:
        # visual words rank transformed relatives best; the global descriptor adds a second opinion
        nn = knn_pairs(np.stack([p.descriptor for p in prints]), max(cfg.neighbours_per_image // 2, 1))
        vocab, words = vocabulary([p.features.descriptors for p in prints],
                                  [p.features.descriptors_mirror for p in prints])
        for pair, sim in knn_cosine(words, cfg.neighbours_per_image).items():
            nn[pair] = max(nn.get(pair, -1.0), sim)
        zoom = _zoom_pairs(prints, vocab, words, cfg, set(ph) | set(nn))
    for p in prints:  # quantised: not needed again, and the verification workers fork after this
        p.zoom_descriptors = []
    t_cand = time.perf_counter()
    # most similar first, so implied (already connected) pairs are skipped as early as possible
    candidates = sorted(set(ph) | set(nn) | set(zoom), key=lambda p: (p not in ph, -nn.get(p, zoom.get(p, 0.0)), p))
    _STATE["prints"] = prints
    failures: list[dict] = []
    batch = max(256, 64 * threads)
    bar = Progress(len(candidates), "verify", "pair", logger=log, bar=progress)
    # one pool for every batch, forked after the fingerprints exist so workers inherit them
    pool = get_context("fork").Pool(threads) if threads > 1 and len(candidates) >= 64 else None
    verify_map = (lambda items: pool.imap(_verify_pair, items, chunksize=8)) if pool else \
        (lambda items: map(_verify_pair, items))
    try:
        _verify_batches(candidates, batch, digests, uf, ph, nn, zoom, cfg, edge, failures, verify_map, bar)
        t_link = time.perf_counter()
        links = 0
        if cfg.link_min_inliers is not None:
            links = link_families(uf, edges, words, cfg.link_min_inliers, cfg.link_min_pairs, cfg.min_inliers,
                                  lambda todo: list(verify_map(todo)), edge, failures)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    bar.close()
    verified = sum(1 for e in edges if e["decision"] in ("confirmed", "rejected", "failed") and e["stage"] != "exact")
    implied = sum(1 for e in edges if e["decision"] == "implied")
    _STATE.clear()
    t_end = time.perf_counter()
    confirmed = [(e["a"], e["b"]) for e in edges if e["decision"] == "confirmed"]
    fams = components(len(paths), confirmed)
    stats = {
        "images": len(paths),
        "exact_groups": len(exact),
        "phash_pairs": len(ph),
        "descriptor_pairs": len(nn),  # global-descriptor and visual-word neighbours
        **({"zoom_pairs": len(zoom)} if cfg.zoom_views else {}),  # proposed by the zoom views alone
        "candidates": len(candidates),
        "verified": verified,
        "implied": implied,
        "confirmed_by_stage": {s: sum(1 for e in edges if e["stage"] == s and e["decision"] == "confirmed")
                               for s in ("exact", "phash", "descriptor", *(("zoom",) if cfg.zoom_views else ()),
                                         *(("link",) if links else ()))},
        "rejected": sum(1 for e in edges if e["decision"] == "rejected"),
        "families": sum(1 for f in fams if len(f) > 1),
        "images_in_families": sum(len(f) for f in fams if len(f) > 1),
        "largest_family": max((len(f) for f in fams), default=0),
        "seconds": {"fingerprint": round(t_fp - t0, 2), "candidates": round(t_cand - t_fp, 2),
                    "verify": round(t_link - t_cand, 2), **({"link": round(t_end - t_link, 2)}
                                                            if cfg.link_min_inliers is not None else {}),
                    "total": round(t_end - t0, 2)},
    }
    if cfg.link_min_inliers is not None:
        stats["family_links"] = links
    log.info("clearance: %s", stats)
    return AuditResult(digests, edges, fams, stats, failures, hashes)
