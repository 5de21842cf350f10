"""Beer-Lambert rendering of hematoxylin and eosin concentration maps into RGB.

Transmitted light through a stained section follows I = I0 * exp(-OD) with the optical
density OD = c_H * v_H + c_E * v_E, where v_H and v_E are the stains' unit OD vectors.
Sites differ in their stain vectors (chemistry, protocol), stain uptake (gains), and the
scanner (illuminant white point, tone curve, optical blur, sensor noise, JPEG quality).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.ndimage import gaussian_filter

# Ruifrok & Johnston's H&E optical-density vectors (unit-normalised below).
HEMATOXYLIN_OD = np.array([0.650, 0.704, 0.286])
EOSIN_OD = np.array([0.072, 0.990, 0.105])


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@dataclass(frozen=True)
class SiteStyle:
    """Stain chemistry and scanner of one acquisition site."""

    hematoxylin: tuple[float, float, float]
    eosin: tuple[float, float, float]
    h_gain: float          # stain uptake multiplier on hematoxylin concentration
    e_gain: float
    illuminant: tuple[float, float, float]  # scanner white point, 0..255 per channel
    gamma: float           # scanner tone curve applied to transmittance
    blur_sigma: float      # optical point-spread, pixels at the base scale
    noise_sd: float        # sensor noise, 0..255 units
    jpeg_quality: int

    def jittered(self, rng: np.random.Generator) -> SiteStyle:
        """Slide-to-slide variation inside one site: small stain-vector and uptake jitter."""
        h = unit(np.asarray(self.hematoxylin) + rng.normal(0, 0.03, 3)).clip(0.01)
        e = unit(np.asarray(self.eosin) + rng.normal(0, 0.03, 3)).clip(0.01)
        return replace(
            self,
            hematoxylin=tuple(unit(h)),
            eosin=tuple(unit(e)),
            h_gain=self.h_gain * float(rng.uniform(0.9, 1.1)),
            e_gain=self.e_gain * float(rng.uniform(0.9, 1.1)),
        )


def _style(h, e, hg, eg, ill, gamma, blur, noise, q) -> SiteStyle:
    return SiteStyle(tuple(unit(np.asarray(h, float))), tuple(unit(np.asarray(e, float))),
                     hg, eg, ill, gamma, blur, noise, q)


#: The five client sources and the external site. The external site keeps morphology and
#: changes chemistry and scanner, as LungHist700 differs from LC25000.
SITE_STYLES: dict[str, SiteStyle] = {
    "site1": _style(HEMATOXYLIN_OD, EOSIN_OD, 1.00, 1.00, (250, 248, 252), 1.00, 0.5, 2.0, 92),
    "site2": _style((0.55, 0.76, 0.35), (0.10, 0.98, 0.15), 1.25, 0.85, (246, 246, 255), 1.05, 0.6, 2.5, 90),
    "site3": _style((0.68, 0.68, 0.27), (0.05, 0.95, 0.30), 0.85, 1.30, (255, 246, 246), 0.95, 0.4, 2.0, 94),
    "site4": _style((0.62, 0.72, 0.31), (0.09, 0.99, 0.08), 0.70, 0.70, (255, 252, 238), 0.90, 0.8, 3.0, 88),
    "site5": _style((0.48, 0.80, 0.36), (0.15, 0.93, 0.33), 1.15, 1.05, (242, 244, 250), 1.10, 0.3, 1.5, 95),
    "external": _style((0.72, 0.62, 0.31), (0.02, 0.88, 0.47), 1.20, 1.35, (255, 240, 232), 1.15, 1.1, 4.0, 80),
}


def render_rgb(conc_h: np.ndarray, conc_e: np.ndarray, style: SiteStyle, rng: np.random.Generator,
               scale: float = 1.0) -> np.ndarray:
    """Concentration maps (H x W, >= 0) -> uint8 RGB through Beer-Lambert and the site's scanner."""
    od = (conc_h[..., None] * style.h_gain) * np.asarray(style.hematoxylin) \
        + (conc_e[..., None] * style.e_gain) * np.asarray(style.eosin)
    transmittance = np.exp(-od)
    if style.blur_sigma > 0:
        transmittance = gaussian_filter(transmittance, sigma=(style.blur_sigma * scale, style.blur_sigma * scale, 0))
    transmittance = np.power(transmittance, style.gamma)
    rgb = transmittance * np.asarray(style.illuminant, float)
    rgb = rgb + rng.normal(0.0, style.noise_sd, rgb.shape)
    return np.clip(np.rint(rgb), 0, 255).astype(np.uint8)


def rgb_to_od(rgb: np.ndarray, background: float = 255.0) -> np.ndarray:
    """Optical density with the usual +1 offset so black pixels stay finite."""
    return -np.log((rgb.astype(np.float64) + 1.0) / (background + 1.0))


def od_to_rgb(od: np.ndarray, background: float = 255.0) -> np.ndarray:
    return np.clip(np.rint(np.exp(-od) * (background + 1.0) - 1.0), 0, 255).astype(np.uint8)


# The dose-response line between a client site's style and the external site's (the shifted cohort of the
# dose-response experiment renders along it; the embedded cohort's external site at cfg.external_severity).
#: JPEG quality range kept under extrapolation: below 40 libjpeg's 8x8 block artefacts dominate a
#: 160-pixel tile (the experiment would measure compression, not stain); above 95 Pillow warns that
#: quantisation is partly disabled, and no site here stores above 95.
JPEG_QUALITY_RANGE = (40, 95)
STAIN_FLOOR = 0.01  # every stain absorbs a little in every channel; a zero component is not a real dye


def _lerp(a: float, b: float, s: float) -> float:
    return (1.0 - s) * float(a) + s * float(b)


def _stain_vector(a: Sequence[float], b: Sequence[float], s: float) -> tuple[float, ...]:
    v = unit(np.array([_lerp(x, y, s) for x, y in zip(a, b, strict=True)]).clip(STAIN_FLOOR))
    # normalising a vector longer than 1 pushes a floored component back under the floor: pin the floored
    # components and shrink the others to keep unit length (repeat in case that floors another one)
    pinned = np.zeros(len(v), bool)
    while (v[~pinned] < STAIN_FLOOR).any() and not pinned.all():
        pinned |= v < STAIN_FLOOR
        v[pinned] = STAIN_FLOOR
        v[~pinned] *= np.sqrt(1.0 - pinned.sum() * STAIN_FLOOR**2) / np.linalg.norm(v[~pinned])
    return tuple(float(x) for x in v)


def style_at(severity: float, anchor: str = "site1") -> SiteStyle:
    """The stain chemistry and scanner at ``severity`` on the line from ``anchor`` (0) to the external site (1).

    Linear in every field, extrapolated beyond 1; stain vectors are renormalised to unit length with
    components >= 0.01, gains kept >= 0.05 and gamma >= 0.3 (Beer-Lambert and the tone curve stay
    physical), illuminant within 0..255, blur and noise >= 0, JPEG quality rounded into
    :data:`JPEG_QUALITY_RANGE`.
    """
    if severity < 0:
        raise ValueError(f"severity must be >= 0 (got {severity})")
    if anchor not in SITE_STYLES or anchor == "external":
        raise ValueError(f"anchor must be a client site, one of {[s for s in SITE_STYLES if s != 'external']}")
    a, b = SITE_STYLES[anchor], SITE_STYLES["external"]
    if severity == 0:  # exact endpoints: no round-off from renormalising already-unit vectors
        return a
    if severity == 1:
        return b
    s = float(severity)
    lo, hi = JPEG_QUALITY_RANGE
    return SiteStyle(
        hematoxylin=_stain_vector(a.hematoxylin, b.hematoxylin, s),
        eosin=_stain_vector(a.eosin, b.eosin, s),
        h_gain=max(_lerp(a.h_gain, b.h_gain, s), 0.05),
        e_gain=max(_lerp(a.e_gain, b.e_gain, s), 0.05),
        illuminant=tuple(float(np.clip(_lerp(x, y, s), 0.0, 255.0)) for x, y in zip(a.illuminant, b.illuminant,
                                                                                    strict=True)),
        gamma=max(_lerp(a.gamma, b.gamma, s), 0.3),
        blur_sigma=max(_lerp(a.blur_sigma, b.blur_sigma, s), 0.0),
        noise_sd=max(_lerp(a.noise_sd, b.noise_sd, s), 0.0),
        jpeg_quality=int(np.clip(round(_lerp(a.jpeg_quality, b.jpeg_quality, s)), lo, hi)),
    )
