from __future__ import annotations

from pathlib import Path

import imagehash
import numpy as np
import pytest
from PIL import Image

from fedhisto.clearance.engine import audit_images
from fedhisto.clearance.families import components, pairwise_scores
from fedhisto.clearance.hashing import dihedral_phashes, phash_pairs
from fedhisto.clearance.stage import ClearanceError, run_audit_folder
from fedhisto.clearance.verify import extract, make_detector, ratio_matches, verify
from fedhisto.config.study import ClearanceConfig
from fedhisto.synth.relatives import encode_jpeg, rotate_zoom, stain_shift
from fedhisto.synth.stain_styles import SITE_STYLES, render_rgb
from fedhisto.synth.tissue import tissue


def tile(label: str, seed: int, size: int = 192) -> Image.Image:
    rng = np.random.default_rng(seed)
    h, e = tissue(label, rng, size, size / 128)
    return Image.fromarray(render_rgb(h, e, SITE_STYLES["site1"], rng, size / 128))


@pytest.fixture(scope="module")
def detector():
    return make_detector("sift", 400)


def test_dihedral_phash_catches_every_flip_and_rotation():
    img = tile("SCC", 1)
    base = dihedral_phashes(np.asarray(img))
    for op in Image.Transpose:
        other = dihedral_phashes(np.asarray(img.transpose(op)))[0]
        assert min(bin(int(b) ^ int(other)).count("1") for b in base) <= 2, op
    assert dihedral_phashes(np.asarray(img), dihedral=False).shape == (1,)


@pytest.mark.parametrize(("size", "aspect"), [(97, 1.0), (128, 0.75), (224, 1.0), (300, 0.6)])
def test_dihedral_phash_is_imagehash_phash(size, aspect):
    """The fast path is imagehash's PHash, bit for bit: the identity hash of the image, and each
    dihedral variant that of the transformed 32 x 32 thumbnail imagehash itself resizes to."""
    img = tile("Normal", size, size).crop((0, 0, size, round(size * aspect)))
    ours = [int(h) for h in dihedral_phashes(np.asarray(img))]
    as_int = lambda h: int(str(h), 16)  # noqa: E731  (imagehash's hex is the row-major bit string)
    assert ours[0] == as_int(imagehash.phash(img))
    thumb = img.convert("L").resize((32, 32), Image.Resampling.LANCZOS)
    assert set(ours) == {as_int(imagehash.phash(thumb))} | {as_int(imagehash.phash(thumb.transpose(op)))
                                                            for op in Image.Transpose}
    for op in Image.Transpose:  # the full image transformed first: PIL's resize rounding moves <= 2 bits
        theirs = as_int(imagehash.phash(img.transpose(op)))
        assert min(bin(h ^ theirs).count("1") for h in ours) <= 2, op


def test_phash_pairs_threshold_and_order():
    hashes = np.array([[0b0], [0b111], [0b11111111111]], dtype=np.uint64)
    assert phash_pairs(hashes, 3) == [(0, 1, 3)]
    assert phash_pairs(hashes, 11) == [(0, 1, 3), (0, 2, 11), (1, 2, 8)]


@pytest.mark.parametrize(
    "make_copy",
    [
        lambda im, rng: rotate_zoom(im, 23.0),
        lambda im, rng: rotate_zoom(im, -11.0).transpose(Image.Transpose.FLIP_LEFT_RIGHT),
        lambda im, rng: im.crop((20, 30, 170, 180)),
        lambda im, rng: stain_shift(im, rng),
        lambda im, rng: im.resize((120, 120)),
        lambda im, rng: im.transpose(Image.Transpose.ROTATE_90),
    ],
    ids=["rotate-zoom", "rotate-flip", "crop", "stain-shift", "resize", "rot90"],
)
def test_local_features_confirm_transformed_copies(detector, make_copy):
    det, norm = detector
    original = tile("ACA", 7)
    copy = make_copy(original, np.random.default_rng(0))
    v = verify(extract(np.asarray(original), det), extract(np.asarray(copy.convert("RGB")), det), norm, 0.75, 10)
    assert v.confirmed(10), v


@pytest.mark.parametrize(("a", "b"), [("ACA", "ACA"), ("SCC", "SCC"), ("Normal", "Normal"), ("ACA", "SCC")])
def test_unrelated_tissue_is_rejected(detector, a, b):
    det, norm = detector
    v = verify(extract(np.asarray(tile(a, 11)), det), extract(np.asarray(tile(b, 12)), det), norm, 0.75, 10)
    assert not v.confirmed(10) and v.inliers < 10


def _opencv_ratio_matches(da, db, norm, ratio):
    import cv2

    knn = cv2.BFMatcher(norm).knnMatch(da, db, k=2)
    good = [m[0] for m in knn if len(m) == 2 and m[0].distance < ratio * m[1].distance]
    return [g.queryIdx for g in good], [g.trainIdx for g in good]


@pytest.mark.parametrize("case", ["sift_pictures", "random_integers", "near_copies_and_ties", "non_integral"])
def test_ratio_matches_are_opencvs_brute_force_knn_match(case):
    """The matrix-product matcher returns OpenCV's knnMatch(k=2) + ratio test, index for index: on real
    SIFT features (direct and mirrored), on integer descriptors up to 255 (the exactness bound), on
    copies with ties between nearest and second, and (through OpenCV itself) on non-integral floats."""
    import cv2

    rng = np.random.default_rng(7)
    if case == "sift_pictures":
        det, _ = make_detector("sift", 400)
        original = tile("ACA", 7)
        a = extract(np.asarray(original), det)
        b = extract(np.asarray(rotate_zoom(original, 17.0).convert("RGB")), det)
        pairs = [(a.descriptors, b.descriptors), (a.descriptors_mirror, b.descriptors), (a.descriptors, a.descriptors)]
    elif case == "random_integers":
        pairs = [(rng.integers(0, 256, (300, 128)).astype(np.float32), rng.integers(0, 256, (250, 128)).astype(np.float32))]
    elif case == "near_copies_and_ties":
        db = rng.integers(0, 256, (200, 128)).astype(np.float32)
        db[100:] = db[:100]  # every train row twice: nearest and second tie
        da = np.clip(db[:150] + rng.integers(-2, 3, (150, 128)), 0, 255).astype(np.float32)
        pairs = [(da, db), (da, db[:100])]
    else:
        da = rng.random((120, 128), np.float32)
        pairs = [(da, (da[:90] + 0.01 * rng.random((90, 128))).astype(np.float32))]
    found = []
    for da, db in pairs:
        q, t = ratio_matches(da, db, cv2.NORM_L2, 0.75)
        q_cv, t_cv = _opencv_ratio_matches(da, db, cv2.NORM_L2, 0.75)
        assert (q.tolist(), t.tolist()) == (q_cv, t_cv)
        found.append(len(q))
    # the cases must reach both outcomes of the test: matches found (copies) and none (ties, noise)
    expected = {"sift_pictures": [True, None, True], "random_integers": [False],
                "near_copies_and_ties": [False, True], "non_integral": [True]}[case]
    assert [None if e is None else n >= 50 for n, e in zip(found, expected, strict=True)] == expected, found


def test_components_keep_first_listed_as_root():
    assert components(5, [(3, 1), (1, 4)]) == [[0], [1, 3, 4], [2]]


def test_pairwise_scores_by_hand():
    s = pairwise_scores(["a", "a", "a", "b"], ["x", "x", "y", "y"])
    assert (s["precision"], s["recall"]) == (0.5, pytest.approx(1 / 3))


def test_engine_finds_planted_families_and_nothing_else(tmp_path: Path):
    paths, truth = [], []
    for k in range(6):
        original = tile(("ACA", "Normal", "SCC")[k % 3], 100 + k)
        members = [original, rotate_zoom(original, 9.0 + k), original.transpose(Image.Transpose.FLIP_TOP_BOTTOM)]
        for m, img in enumerate(members):
            p = tmp_path / f"f{k}_{m}.jpg"
            p.write_bytes(encode_jpeg(img, 90))
            paths.append(str(p))
            truth.append(f"f{k}")
    (tmp_path / "dup.jpg").write_bytes(Path(paths[0]).read_bytes())
    paths.append(str(tmp_path / "dup.jpg"))
    truth.append("f0")
    res = audit_images(paths, ClearanceConfig(neighbours_per_image=4), threads=1, progress=False)
    found = {i: n for n, fam in enumerate(res.families) for i in fam}
    scores = pairwise_scores(truth, [str(found[i]) for i in range(len(paths))])
    assert scores["f1"] == 1.0
    assert res.stats["confirmed_by_stage"]["exact"] == 1
    assert not res.failures


def test_audit_folder_writes_outputs_and_stops_on_truncated_file(tmp_path: Path):
    folder = tmp_path / "imgs" / "lung_aca"
    folder.mkdir(parents=True)
    for k in range(3):
        (folder / f"a{k}.jpg").write_bytes(encode_jpeg(tile("ACA", k, 128), 90))
    (folder / "copy.jpg").write_bytes(encode_jpeg(tile("ACA", 0, 128).transpose(Image.Transpose.ROTATE_180), 80))
    audit = run_audit_folder(tmp_path / "imgs", tmp_path / "out", ClearanceConfig(neighbours_per_image=3))
    assert audit["stats"]["families"] == 1
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"edges.csv", "families.csv", "audit.json", "report.md"}
    (folder / "broken.jpg").write_bytes((folder / "a1.jpg").read_bytes()[:500])
    with pytest.raises(OSError, match=r"broken\.jpg"):
        run_audit_folder(tmp_path / "imgs", tmp_path / "out2", ClearanceConfig(neighbours_per_image=3))
    assert not (tmp_path / "out2" / "families.csv").exists()
    with pytest.raises(ClearanceError, match="no images"):
        run_audit_folder(tmp_path / "out", tmp_path / "out3", ClearanceConfig())


def _linking_case(link_min_inliers: int, link_min_pairs: int) -> tuple[list[list[int]], list[dict], list[tuple]]:
    """Families {0, 1} and {2, 3} after the first pass, singletons 4 and 5; verdicts stand in for images."""
    from fedhisto.clearance.linking import link_families
    from fedhisto.clearance.verify import Verdict
    from fedhisto.realdata.union_find import UnionFind

    def row(a, b, decision, inliers, scale):
        return {"a": a, "b": b, "stage": "descriptor", "decision": decision, "inliers": inliers, "scale": scale,
                "angle_deg": 12.0, "mirrored": False}

    uf = UnionFind(6)
    uf.union(0, 1)
    uf.union(2, 3)
    edges = [row(0, 1, "confirmed", 30, 1.0), row(2, 3, "confirmed", 25, 1.0),
             row(0, 2, "rejected", 7, 0.95),   # near miss between the two families
             row(4, 5, "rejected", 8, 1.0),    # near miss between two singletons: their only cross pair
             row(1, 4, "rejected", 9, 0.0)]    # many inliers on a degenerate fit (scale 0): chance, not a near miss
    second_pass = {(1, 3): Verdict(8, 20, 1.02, 11.0, False), (1, 2): Verdict(3, 9, 0.7, 40.0, False),
                   (0, 3): Verdict(2, 8, 3.1, -5.0, True)}
    asked: list[tuple] = []

    def verify_map(todo):
        asked.extend(todo)
        return [(p, second_pass[p]) for p in todo]

    recorded: list[dict] = []

    def edge(a, b, stage, score, threshold, decision, v=None, min_inliers=None):
        recorded.append({"a": a, "b": b, "stage": stage, "decision": decision, "min_inliers": min_inliers,
                         "inliers": v.inliers if v else ""})

    words = np.eye(6, dtype=np.float32)
    words[1, 3] = words[3, 1] = 0.5  # 1-3 the closest unverified cross pair of the two families
    links = link_families(uf, edges, words / np.linalg.norm(words, axis=1, keepdims=True), link_min_inliers,
                          link_min_pairs, 10, verify_map, edge, [])
    assert links == 4 - len({uf.find(i) for i in range(6)})  # each link joins two of the four first-pass families
    return components_of(uf), recorded, asked


def components_of(uf) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i in range(len(uf.parent)):
        groups.setdefault(uf.find(i), []).append(i)
    return sorted(groups.values())


def test_second_pass_links_families_whose_closest_members_nearly_verify():
    fams, recorded, asked = _linking_case(6, 2)
    assert fams == [[0, 1, 2, 3], [4], [5]]  # two near misses link the families; singletons need a full verdict
    assert asked == [(1, 3), (0, 3), (1, 2)]  # only the suspect families' unverified cross pairs, closest first
    links = {(r["a"], r["b"]): r for r in recorded if r["decision"] == "confirmed"}
    assert set(links) == {(0, 2), (1, 3)} and {r["min_inliers"] for r in links.values()} == {6}
    assert {(r["a"], r["b"]) for r in recorded if r["decision"] == "rejected"} == {(0, 3), (1, 2)}


@pytest.mark.parametrize(("inliers", "pairs", "expected"), [
    (8, 2, [[0, 1], [2, 3], [4], [5]]),       # 0-2 (7 inliers) no longer a near miss: nothing is suspect there
    (6, 3, [[0, 1], [2, 3], [4], [5]]),       # two near misses are not three
    (6, 1, [[0, 1, 2, 3], [4, 5]]),           # one near miss suffices, singletons included
])
def test_second_pass_thresholds_are_obeyed(inliers, pairs, expected):
    assert _linking_case(inliers, pairs)[0] == expected


def test_second_pass_key_must_relax_the_threshold():
    with pytest.raises(ValueError, match="link_min_inliers"):
        ClearanceConfig(min_inliers=10, link_min_inliers=12)
    from fedhisto.config.stage_blocks import stage_block
    from fedhisto.config.study import load_config

    # on by default, a behaviour change: both keys are in clearance's identity, and switching it off changes it
    block = stage_block(load_config({}), "clearance")
    assert (block["link_min_inliers"], block["link_min_pairs"]) == (5, 3)
    assert stage_block(load_config({"clearance": {"link_min_inliers": None}}), "clearance") != block


@pytest.mark.parametrize(("stage", "linked"), [("descriptor", True), ("phash", False), ("exact", False)])
def test_near_misses_against_copies_of_one_picture_count_once(stage, linked):
    """Singleton 0 nearly verifies with both members of family {1, 2}: two pieces of evidence when
    1 and 2 are distinct pictures (joined by a local-feature edge), one when they are copies of
    one picture (exact or PHash edge), since a chance match repeats itself on a copy."""
    from fedhisto.clearance.linking import link_families
    from fedhisto.realdata.union_find import UnionFind

    uf = UnionFind(3)
    uf.union(1, 2)
    edges = [{"a": 1, "b": 2, "stage": stage, "decision": "confirmed", "inliers": 40, "scale": 1.0,
              "angle_deg": 0.0, "mirrored": False}]
    edges += [{"a": 0, "b": b, "stage": "descriptor", "decision": "rejected", "inliers": 7, "scale": 1.0,
               "angle_deg": 5.0, "mirrored": False} for b in (1, 2)]
    links = link_families(uf, edges, np.eye(3, dtype=np.float32), 6, 2, 10, lambda todo: [],
                          lambda *args, **kwargs: None, [])
    assert (links == 1) is linked and uf.connected(0, 1) is linked
