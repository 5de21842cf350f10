"""Local-feature verification: keypoints, ratio test, RANSAC similarity, plausibility.

A pair is confirmed when a similarity transform (rotation, uniform scale, translation;
mirror-aware, by also matching against the horizontally flipped image) explains at least
``min_inliers`` ratio-tested matches and its scale is plausible for resizing, cropping or
LC25000's zoom. Unrelated tissue yields a handful of inliers at most, so it cannot chain
families together.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

WORK_EDGE = 256  # images are brought to this longer side so small tiles still yield keypoints
SCALE_RANGE = (0.4, 2.5)
RANSAC_PX = 4.0


@dataclass
class Features:
    points: np.ndarray          # K x 2 float32 (work-frame coordinates)
    descriptors: np.ndarray     # K x D
    points_mirror: np.ndarray
    descriptors_mirror: np.ndarray


@dataclass(frozen=True)
class Verdict:
    inliers: int
    matches: int
    scale: float
    angle_deg: float
    mirrored: bool

    def confirmed(self, min_inliers: int) -> bool:
        return self.inliers >= min_inliers and SCALE_RANGE[0] <= self.scale <= SCALE_RANGE[1]


def make_detector(kind: str, n_features: int):
    if kind == "sift":
        return cv2.SIFT_create(nfeatures=n_features), cv2.NORM_L2
    if kind == "orb":
        return cv2.ORB_create(nfeatures=2 * n_features), cv2.NORM_HAMMING
    raise ValueError(f"unknown detector {kind!r}; allowed: sift, orb")


def _mirror_sift(points: np.ndarray, descriptors: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Features of the horizontally mirrored image without detecting again.

    DoG detection is mirror-symmetric, so mirrored keypoints are the originals with x
    reflected. A SIFT descriptor is a 4 x 4 (rows across, columns along the keypoint
    orientation) x 8 orientation-bin histogram; mirroring reflects the patch about the
    orientation axis, which reverses the rows and negates gradient angles (bin k -> -k mod 8).
    """
    mirrored_points = points.copy()
    mirrored_points[:, 0] = width - 1 - mirrored_points[:, 0]
    d = descriptors.reshape(-1, 4, 4, 8)
    mirrored = d[:, ::-1, :, :][:, :, :, (8 - np.arange(8)) % 8].reshape(-1, 128)
    return mirrored_points, np.ascontiguousarray(mirrored)


def extract(rgb: np.ndarray, detector) -> Features:
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    h, w = grey.shape
    longest = max(h, w)
    if longest > WORK_EDGE or longest < 0.75 * WORK_EDGE:  # keep ~224 px tiles as they are
        f = WORK_EDGE / longest
        grey = cv2.resize(grey, (max(round(w * f), 8), max(round(h * f), 8)),
                          interpolation=cv2.INTER_AREA if f < 1 else cv2.INTER_CUBIC)
    kps, des = detector.detectAndCompute(grey, None)
    if des is None or not kps:
        empty = np.zeros((0, 2), np.float32)
        return Features(empty, np.zeros((0, 128), np.float32), empty, np.zeros((0, 128), np.float32))
    points = np.float32([kp.pt for kp in kps])
    if des.dtype == np.float32 and des.shape[1] == 128:  # SIFT: mirror by permutation
        pm, dm = _mirror_sift(points, des, grey.shape[1])
        return Features(points, des, pm, dm)
    flipped = cv2.flip(grey, 1)  # ORB descriptors have no such symmetry: detect again
    kps_m, des_m = detector.detectAndCompute(flipped, None)
    if des_m is None:
        return Features(points, des, np.zeros((0, 2), np.float32), np.zeros((0, des.shape[1]), des.dtype))
    return Features(points, des, np.float32([kp.pt for kp in kps_m]), des_m)


def _integral(d: np.ndarray) -> bool:
    return d.dtype == np.float32 and bool(np.all(d == np.rint(d))) and float(np.abs(d).max(initial=0)) <= 255


def ratio_matches(da: np.ndarray, db: np.ndarray, norm: int, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Lowe's ratio test over each query descriptor's two nearest train descriptors: (query, train)
    indices of the matches whose nearest distance is below ``ratio`` x the second's, in query order.

    The result is OpenCV's brute-force ``knnMatch(k=2)``'s, bit for bit, and several times faster for
    SIFT (half of clearance's time was OpenCV's per-pair matcher). OpenCV's SIFT descriptors are
    integers 0-255 stored as float32, so every dot product, squared norm and squared distance is an
    integer below 2**24 (2 x 128 x 255**2): float32 arithmetic is exact in any summation order, and the float32
    square root of the exact squared distance is the distance OpenCV computes. Ties between the
    nearest and the second never pass the test (d1 < ratio x d1 is false), so which index a tie picks
    does not matter. Other descriptors (ORB's binary ones, non-integral floats) use OpenCV's matcher."""
    if norm != cv2.NORM_L2 or not (_integral(da) and _integral(db)):
        knn = cv2.BFMatcher(norm).knnMatch(da, db, k=2)
        good = [m[0] for m in knn if len(m) == 2 and m[0].distance < ratio * m[1].distance]
        return (np.array([g.queryIdx for g in good], dtype=np.intp), np.array([g.trainIdx for g in good], dtype=np.intp))
    # |a - b|^2 = |a|^2 + (|b|^2 - 2 a.b): the row term |a|^2 does not move a row's argmin, and the
    # bracket is built in place in the product's buffer (fresh 400 x 400 temporaries cost more in page
    # faults than the arithmetic). Exact: integers below 2 x 128 x 255**2 < 2**24.
    d2 = da @ db.T
    d2 *= -2.0
    d2 += np.einsum("ij,ij->i", db, db)[None, :]
    rows = np.arange(len(da))
    nearest = np.argmin(d2, axis=1)
    sq_a = np.einsum("ij,ij->i", da, da)
    first = d2[rows, nearest] + sq_a
    d2[rows, nearest] = np.inf
    second = d2.min(axis=1) + sq_a
    keep = np.sqrt(first).astype(np.float64) < ratio * np.sqrt(second).astype(np.float64)  # OpenCV's float32 distances
    query = np.flatnonzero(keep)
    return query, nearest[query]


def _fit(pa: np.ndarray, da: np.ndarray, pb: np.ndarray, db: np.ndarray, norm: int, ratio: float,
         mirrored: bool) -> Verdict:
    none = Verdict(0, 0, 0.0, 0.0, mirrored)
    if len(da) < 2 or len(db) < 2:
        return none
    query, train = ratio_matches(da, db, norm, ratio)
    if len(query) < 3:
        return Verdict(0, len(query), 0.0, 0.0, mirrored)
    src = pa[query]
    dst = pb[train]
    model, mask = cv2.estimateAffinePartial2D(src, dst, method=cv2.RANSAC, ransacReprojThreshold=RANSAC_PX,
                                              maxIters=2000, confidence=0.995, refineIters=10)
    if model is None:
        return Verdict(0, len(query), 0.0, 0.0, mirrored)
    scale = float(np.sqrt(abs(np.linalg.det(model[:, :2]))))
    angle = float(np.degrees(np.arctan2(model[1, 0], model[0, 0])))
    return Verdict(int(mask.sum()), len(query), scale, angle, mirrored)


def verify(a: Features, b: Features, norm: int, ratio: float, min_inliers: int) -> Verdict:
    """Best of direct and mirrored matching; the mirrored attempt only runs when direct fails."""
    direct = _fit(a.points, a.descriptors, b.points, b.descriptors, norm, ratio, mirrored=False)
    if direct.confirmed(min_inliers):
        return direct
    mirror = _fit(a.points_mirror, a.descriptors_mirror, b.points, b.descriptors, norm, ratio, mirrored=True)
    return mirror if mirror.inliers > direct.inliers else direct
