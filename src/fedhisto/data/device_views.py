"""Training views rendered on the device from uint8 images kept there (issue 14, "study-scale speed").

The host path (``fedhisto.data.views.training_views``) makes every view with numpy/OpenCV, one image at a
time, which bounds a GPU step by the host (docs/changelog.md). Here the split's images are decoded
once and stored on the device as uint8 (``DeviceImages``); per step the host only draws parameters
(``draw_views``: a dozen numbers per image, no pixels) and ``render_views`` makes every view of the
batch with batched tensor ops, without ``.item()`` or any other device-to-host read.

Same random draws: ``draw_views`` consumes the generator of ``view_rng(seed, epoch, sample_id)`` in
the order ``training_views`` does (RandomResizedCrop/flip/rotation parameters, then per view the OD
mix noise, its diagonal scale, brightness, contrast; nothing more for an unperturbed single view).

What differs from the host path (pixels only, never the draws):

- Geometry. The host resizes the crop (cv2 bilinear, edge pixels replicated), flips, then rotates
  (cv2 ``warpAffine`` bilinear, white outside) and rounds to uint8 after each interpolation. Here
  the inverse maps (rotation about the centre ``(size - 1) / 2``, un-flip, un-resize with cv2's
  half-pixel convention ``src = (dst + 0.5) * scale - 0.5``, clamped to the crop box as cv2's
  resize replicates its edge) become ``grid_sample`` grids (bilinear, align_corners=True so grid
  points are pixel centres) evaluated in float32 without rounding. By default (``two_pass``) the
  two interpolations are kept, resize+flips then rotation with a zero-padded "minus white" image
  (white fill exactly as ``warpAffine``'s constant border): mean absolute difference to the host
  0.0005-0.002 in [0, 1] RGB units, the host's uint8 rounding. With ``two_pass=False`` the whole
  geometry is ONE grid per view (one interpolation, white blended by the share of the rotation's
  bilinear footprint outside the resized image); each stage alone matches the host to 0.001, but
  one interpolation instead of two is visibly sharper on noisy tissue after a rotation (mean
  difference 0.004-0.031, correlation 0.964-0.989), i.e. a different augmentation distribution,
  which is why it is not the default. With no rotation and an unscaled full crop both modes hit
  pixel centres and give the host's pixels.
- Stain. The same OD-space mix, clip, brightness and contrast (pivoting on each view's mean grey),
  in float32 instead of float64 (difference below 1e-4 on identical input pixels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from fedhisto.config.study import ViewsConfig
from fedhisto.data.views import Geometry, sample_geometry, view_rng

#: torchvision's grey weights (``stain_perturb``'s contrast pivot).
GREY = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class StainDraw:
    """One view's stain perturbation: the OD mix (I + noise, diagonal scaled), brightness, contrast."""

    mix: np.ndarray
    brightness: float
    contrast: float


@dataclass(frozen=True)
class ViewDraws:
    """Every random parameter of one image's views: a shared geometry and one stain entry per view
    (``None``: no stain perturbation, the view is the geometry divided by 255)."""

    geometry: Geometry
    stains: tuple[StainDraw | None, ...]


def draw_stain(rng: np.random.Generator, cfg: ViewsConfig) -> StainDraw:
    """``stain_perturb``'s draws in its order: mix noise, diagonal scale, brightness, contrast."""
    mix = np.eye(3) + rng.normal(0.0, cfg.od_noise_sd, (3, 3))
    mix[np.diag_indices(3)] *= rng.uniform(*cfg.od_diag_scale, 3)
    brightness = float(rng.uniform(*cfg.brightness))
    return StainDraw(mix, brightness, float(rng.uniform(*cfg.contrast)))


def draw_views(seed: int, epoch: int, sample_id: str, height: int, width: int, cfg: ViewsConfig,
               paired: bool, stain_single: bool | None = None) -> ViewDraws:
    """The parameters ``training_views`` draws for an image of ``height`` x ``width``, no pixels."""
    rng = view_rng(seed, epoch, sample_id)
    geometry = sample_geometry(rng, height, width, cfg)
    if paired:
        return ViewDraws(geometry, (draw_stain(rng, cfg), draw_stain(rng, cfg)))
    perturb = cfg.single_view_stain if stain_single is None else stain_single
    return ViewDraws(geometry, (draw_stain(rng, cfg) if perturb else None,))


class DeviceImages:
    """A split's decoded uint8 RGB images stored once on the device, (N, 3, H, W) padded with white
    to the largest height and width; ``heights``/``widths`` stay on the host so drawing views never
    reads the device."""

    def __init__(self, images: Sequence[np.ndarray], device: torch.device | str = "cpu"):
        if not images:
            raise ValueError("DeviceImages needs at least one image")
        self.heights = [int(im.shape[0]) for im in images]
        self.widths = [int(im.shape[1]) for im in images]
        store = torch.full((len(images), 3, max(self.heights), max(self.widths)), 255, dtype=torch.uint8)
        for k, im in enumerate(images):
            if im.dtype != np.uint8 or im.ndim != 3 or im.shape[2] != 3:
                raise ValueError(f"image {k}: expected uint8 H x W x 3, got {im.dtype} {im.shape}")
            store[k, :, :im.shape[0], :im.shape[1]] = torch.from_numpy(im).permute(2, 0, 1)
        self.data = store.to(device)

    @classmethod
    def from_split(cls, split, device: torch.device | str = "cpu") -> DeviceImages:
        """From ``fedhisto.data.splits.Split`` (its ``images``, in its order)."""
        return cls(split.images, device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __len__(self) -> int:
        return self.data.shape[0]


@dataclass
class PackedDraws:
    """``ViewDraws`` of a batch as tensors on the device (one host-to-device copy per batch).

    ``geometry`` (B, 12): inverse rotation (2 x 3, row-major), hflip, vflip, then the crop box's
    left, top, width, height; ``mix`` (V, B, 3, 3), ``brightness``/``contrast`` (V, B);
    ``perturbed``: per view, on the host, whether it carries a stain perturbation."""

    geometry: torch.Tensor
    mix: torch.Tensor
    brightness: torch.Tensor
    contrast: torch.Tensor
    perturbed: list[list[bool]]


def _inverse_rotation(angle: float, size: int) -> np.ndarray:
    """The map from output pixels to the flipped resized image's pixels that ``warpAffine`` samples."""
    centre = ((size - 1) / 2, (size - 1) / 2)
    return cv2.invertAffineTransform(cv2.getRotationMatrix2D(centre, angle, 1.0))


def pack_draws(draws: Sequence[ViewDraws], size: int, device: torch.device | str) -> PackedDraws:
    views = len(draws[0].stains)
    if any(len(d.stains) != views for d in draws):
        raise ValueError("every image of a batch needs the same number of views")
    geometry = np.zeros((len(draws), 12))
    mix = np.tile(np.eye(3), (views, len(draws), 1, 1))
    factors = np.ones((2, views, len(draws)))
    for b, d in enumerate(draws):
        g = d.geometry
        geometry[b] = [*_inverse_rotation(g.angle, size).ravel(), g.hflip, g.vflip, g.left, g.top, g.width, g.height]
        for v, s in enumerate(d.stains):
            if s is not None:
                mix[v, b], factors[0, v, b], factors[1, v, b] = s.mix, s.brightness, s.contrast
    # one float32 buffer, so a batch costs one (non-blocking) copy
    flat = np.concatenate([geometry.ravel(), mix.ravel(), factors.ravel()]).astype(np.float32)
    buf = torch.from_numpy(flat).to(device, non_blocking=True)
    n_geo, n_mix = geometry.size, mix.size
    return PackedDraws(buf[:n_geo].view(len(draws), 12), buf[n_geo:n_geo + n_mix].view(views, len(draws), 3, 3),
                       buf[n_geo + n_mix:].view(2, views, len(draws))[0],
                       buf[n_geo + n_mix:].view(2, views, len(draws))[1],
                       [[s is not None for s in d.stains] for d in draws])


def _footprint_inside(coord: torch.Tensor, size: int) -> torch.Tensor:
    """Fraction of a bilinear tap pair at ``coord`` that falls on pixels 0..size-1 (the rest is white)."""
    return (1 - F.relu(-coord) - F.relu(coord - (size - 1))).clamp(0, 1)


def _normalised(x: torch.Tensor, y: torch.Tensor, height: int, width: int, size: int) -> torch.Tensor:
    """Pixel coordinates (B, size*size) as a ``grid_sample`` grid; with align_corners=True -1 and 1 are
    the centres of the first and last pixel, so pixel indices map exactly as cv2 indexes them."""
    grid = torch.stack([x * (2 / max(width - 1, 1)) - 1, y * (2 / max(height - 1, 1)) - 1], -1)
    return grid.view(-1, size, size, 2)


def render_geometry(images: DeviceImages, index: torch.Tensor, geometry: torch.Tensor, size: int,
                    two_pass: bool = True) -> torch.Tensor:
    """Crop, resize, flips and rotation of each indexed image: (B, 3, size, size) float32 in 0..255.

    ``two_pass`` (default): resize and flips, then the rotation of that result, the host's two
    bilinear interpolations; otherwise one sampling grid per view (see the module docstring)."""
    dev, (height, width) = images.device, images.data.shape[2:]
    axis = torch.arange(size, device=dev, dtype=torch.float32)
    ys, xs = torch.meshgrid(axis, axis, indexing="ij")
    base = torch.stack([xs, ys, torch.ones_like(xs)], -1).view(1, size * size, 3)
    rotated = base @ geometry[:, :6].view(-1, 2, 3).transpose(1, 2)  # (B, size*size, 2), flipped resized frame
    xr, yr = rotated[..., 0], rotated[..., 1]
    col = lambda k: geometry[:, k:k + 1]  # noqa: E731  (B, 1), broadcasts over pixels
    left, top, w, h = col(8), col(9), col(10), col(11)

    def crop_coords(xq: torch.Tensor, yq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flipped resized frame -> source pixels: un-flip, then cv2's resize (half-pixel centres,
        the CROP's edge pixels replicated, hence the clamp to the crop box)."""
        xf = torch.where(col(6) > 0.5, (size - 1) - xq, xq)
        yf = torch.where(col(7) > 0.5, (size - 1) - yq, yq)
        sx = torch.minimum(torch.maximum(left + (xf + 0.5) * (w / size) - 0.5, left), left + w - 1)
        sy = torch.minimum(torch.maximum(top + (yf + 0.5) * (h / size) - 0.5, top), top + h - 1)
        return sx, sy

    src = images.data.index_select(0, index).float()
    sample = lambda img, grid, pad: F.grid_sample(img, grid, mode="bilinear", padding_mode=pad,  # noqa: E731
                                                  align_corners=True)
    if two_pass:
        resized = sample(src, _normalised(*crop_coords(base[..., 0], base[..., 1]), height, width, size), "border")
        # warpAffine's constant border: taps outside the resized image read white (255 - 255 = 0)
        return sample(resized - 255.0, _normalised(xr, yr, size, size, size), "zeros") + 255.0
    out = sample(src, _normalised(*crop_coords(xr, yr), height, width, size), "border")
    # the white fill: the share of the rotation's bilinear footprint outside the resized image
    inside = (_footprint_inside(xr, size) * _footprint_inside(yr, size)).view(-1, 1, size, size)
    return out * inside + 255.0 * (1 - inside)


def stain_batch(x255: torch.Tensor, mix: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor,
                cfg: ViewsConfig) -> torch.Tensor:
    """``stain_perturb`` for (N, 3, H, W) pixels in 0..255, each with its own (3, 3) mix and factors;
    float RGB in [0, 1]."""
    od = -torch.log((x255 + 1.0) / 256.0)
    od = torch.einsum("nij,njhw->nihw", mix, od).clamp(0.0, cfg.od_clip)  # the host's od @ mix.T
    img = (torch.exp(-od) * 256.0 - 1.0).clamp(0, 255) / 255.0
    img = (img * brightness.view(-1, 1, 1, 1)).clamp(0, 1)
    grey_w = torch.tensor(GREY, device=img.device, dtype=img.dtype).view(1, 3, 1, 1)
    grey = (img * grey_w).sum(1, keepdim=True).mean((2, 3), keepdim=True)  # each view's mean grey
    return ((img - grey) * contrast.view(-1, 1, 1, 1) + grey).clamp(0, 1)


def render_views(images: DeviceImages, index: torch.Tensor, draws: Sequence[ViewDraws] | PackedDraws,
                 cfg: ViewsConfig, size: int | None = None, two_pass: bool = True) -> torch.Tensor:
    """Normalised views (V, B, 3, size, size) of the images ``index`` (B, on the device) with their
    ``draws`` (B, aligned with ``index``): ``out[k]`` is every image's k-th view, as
    ``training_views(...)[k]`` stacked over the batch. One grid sample for all images, one stain
    pass for all views; nothing is read back to the host. ``two_pass``: see ``render_geometry``."""
    size = size or cfg.crop_size
    packed = draws if isinstance(draws, PackedDraws) else pack_draws(draws, size, images.device)
    views, batch = packed.brightness.shape
    base = render_geometry(images, index, packed.geometry, size, two_pass)  # (B, 3, S, S), shared by the views
    flags = [[row[v] for row in packed.perturbed] for v in range(views)]
    tiled = base.unsqueeze(0).expand(views, *base.shape)
    if not any(map(any, flags)):
        img = tiled / 255.0
    else:
        flat = tiled.reshape(views * batch, 3, size, size)
        img = stain_batch(flat, packed.mix.reshape(-1, 3, 3), packed.brightness.reshape(-1),
                          packed.contrast.reshape(-1), cfg).view(views, batch, 3, size, size)
        if not all(map(all, flags)):  # a batch mixing perturbed and plain views (the mask is host data)
            keep = torch.tensor(flags, device=img.device).view(views, batch, 1, 1, 1)
            img = torch.where(keep, img, tiled / 255.0)
    mean = torch.tensor(cfg.mean, device=img.device).view(1, 1, 3, 1, 1)
    std = torch.tensor(cfg.std, device=img.device).view(1, 1, 3, 1, 1)
    return (img - mean) / std


def device_views(split, idx: Sequence[int], cfg: ViewsConfig, seed: int, epoch: int, paired: bool,
                 device: torch.device | str, stain_single: bool | None = None) -> torch.Tensor:
    """``train.view_pipeline: device``: the views of ``split`` images ``idx`` (V, B, 3, S, S) on the
    device, as ``training_views`` draws them. The split's uint8 images go to the device once and stay
    there across rounds (cached on the split, per device)."""
    cache = split.__dict__.setdefault("_device_images", {})
    key = str(torch.device(device))
    if key not in cache:
        cache[key] = DeviceImages.from_split(split, device)
    images = cache[key]
    draws = [draw_views(seed, epoch, split.ids[i], images.heights[i], images.widths[i], cfg, paired, stain_single)
             for i in idx]
    index = torch.as_tensor(np.asarray(idx, dtype=np.int64)).to(images.device, non_blocking=True)
    return render_views(images, index, draws, cfg)
