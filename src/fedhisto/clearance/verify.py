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


def _fit(pa: np.ndarray, da: np.ndarray, pb: np.ndarray, db: np.ndarray, norm: int, ratio: float,
         mirrored: bool) -> Verdict:
    none = Verdict(0, 0, 0.0, 0.0, mirrored)
    if len(da) < 2 or len(db) < 2:
        return none
    knn = cv2.BFMatcher(norm).knnMatch(da, db, k=2)
    good = [m[0] for m in knn if len(m) == 2 and m[0].distance < ratio * m[1].distance]
    if len(good) < 3:
        return Verdict(0, len(good), 0.0, 0.0, mirrored)
    src = pa[[g.queryIdx for g in good]]
    dst = pb[[g.trainIdx for g in good]]
    model, mask = cv2.estimateAffinePartial2D(src, dst, method=cv2.RANSAC, ransacReprojThreshold=RANSAC_PX,
                                              maxIters=2000, confidence=0.995, refineIters=10)
    if model is None:
        return Verdict(0, len(good), 0.0, 0.0, mirrored)
    scale = float(np.sqrt(abs(np.linalg.det(model[:, :2]))))
    angle = float(np.degrees(np.arctan2(model[1, 0], model[0, 0])))
    return Verdict(int(mask.sum()), len(good), scale, angle, mirrored)


def verify(a: Features, b: Features, norm: int, ratio: float, min_inliers: int) -> Verdict:
    """Best of direct and mirrored matching; the mirrored attempt only runs when direct fails."""
    direct = _fit(a.points, a.descriptors, b.points, b.descriptors, norm, ratio, mirrored=False)
    if direct.confirmed(min_inliers):
        return direct
    mirror = _fit(a.points_mirror, a.descriptors_mirror, b.points, b.descriptors, norm, ratio, mirrored=True)
    return mirror if mirror.inliers > direct.inliers else direct
