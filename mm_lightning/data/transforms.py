"""Image transforms that decode and crop in one step on uint8 tensors, plus normalization."""

from __future__ import annotations

import math
from typing import Any

import torch
from torchvision.transforms import v2

from mm_lightning.data.images import (
    DCT_SCALES,
    DEFAULT_MAX_PIXELS,
    Backend,
    EncodedImage,
    ImageDecodeError,
    ImageSource,
    dct_scale_for,
    read_image_bytes,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # of 0-1 images (torchvision's and timm's defaults)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_IMAGE_SIZE = 224  # side when neither data nor image tower sets one (e.g. `audit` without a model)

INTERPOLATIONS = ("bilinear", "bicubic")  # antialiased resizes torch runs on uint8 directly
Box = tuple[int, int, int, int]  # top, left, height, width in displayed full-size pixels


class DecodeResizedCrop:
    """Encoded image (path/bytes) or uint8 tensor -> crop chosen from the header -> scaled decode -> resize.
    ``scale=None``: the evaluation crop; ``interpolation``: what the image tower was trained with."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] | None = (0.9, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        horizontal_flip: bool = False,
        reduced_decode: bool = True,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        background: tuple[int, int, int] = (255, 255, 255),
        backend: Backend = "auto",
        interpolation: str = "bilinear",
    ) -> None:
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation {interpolation!r} is not one of {list(INTERPOLATIONS)}")
        self.interpolation = interpolation
        self.size, self.horizontal_flip, self.reduced_decode = size, horizontal_flip, reduced_decode
        self.max_pixels, self.background, self.backend = max_pixels, background, backend
        if scale is not None and (scale[0] > scale[1] or ratio[0] > ratio[1]):
            raise ValueError(f"scale and ratio must be (min, max), got scale={scale}, ratio={ratio}")
        self.scale, self.ratio = scale, ratio
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def crop_box(self, width: int, height: int) -> Box:
        """The crop (top, left, height, width) for this displayed size, drawn like ``RandomResizedCrop``."""
        if self.scale is None:
            side = min(width, height)  # = Resize(shorter side to size) + CenterCrop(size)
            return (height - side) // 2, (width - side) // 2, side, side
        u = torch.rand(22, dtype=torch.float64).tolist()
        (lo, hi), (log_lo, log_hi), area = self.scale, self.log_ratio, width * height
        for k in range(10):
            target_area = area * (lo + (hi - lo) * u[2 * k])
            aspect_ratio = math.exp(log_lo + (log_hi - log_lo) * u[2 * k + 1])
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                return int(u[20] * (height - h + 1)), int(u[21] * (width - w + 1)), h, w
        in_ratio = width / height  # fallback: the central crop with the aspect ratio clamped to ``ratio``
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            w, h = int(round(height * max(self.ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def plan(self, width: int, height: int, scalable: bool = True) -> tuple[Box, int]:
        """Draw the crop and pick the DCT scale to decode it at (the box snapped to that scale's grid)."""
        box = self.crop_box(width, height)
        scale = 1
        if self.reduced_decode and scalable:
            scale = dct_scale_for((box[3], box[2]), (self.size, self.size), DCT_SCALES)
        if scale > 1:
            top, left = (round(v / scale) * scale for v in box[:2])
            bottom, right = (
                min(round(v / scale) * scale, limit)
                for v, limit in ((box[0] + box[2], height), (box[1] + box[3], width))
            )
            box = top, left, bottom - top, right - left
        return box, scale

    def __call__(
        self, source: ImageSource | torch.Tensor, max_aspect_ratio: float | None = None
    ) -> torch.Tensor:
        """RGB uint8 (3, size, size) from an encoded image or a uint8 tensor; ImageDecodeError if unusable."""
        if isinstance(source, torch.Tensor):
            height, width = source.shape[-2:]
            _check_aspect(width, height, max_aspect_ratio)
            image, (box, scale) = source, self.plan(width, height, scalable=False)
        else:
            with EncodedImage(
                read_image_bytes(source), self.max_pixels, self.background, self.backend
            ) as encoded:
                _check_aspect(*encoded.size, max_aspect_ratio)
                box, scale = self.plan(*encoded.size, scalable=encoded.scalable)
                image = encoded.decode(scale)
        if scale > 1:
            # Decoded side = ceil(side / scale): pixel i covers full-size pixels [i * scale, (i + 1) * scale).
            box = tuple(-(-v // scale) if k >= 2 else v // scale for k, v in enumerate(box))
        top, left, height, width = box
        # What v2.functional.resized_crop does, minus its reshapes and copies.
        window = image[None, :, top : top + height, left : left + width]
        out = torch.nn.functional.interpolate(
            window, size=(self.size, self.size), mode=self.interpolation, antialias=True
        )[0]
        if self.horizontal_flip and torch.rand(1) < 0.5:  # after the crop draw, as v2.Compose would
            out = out.flip(-1)
        return out.contiguous()


def _check_aspect(width: int, height: int, max_aspect_ratio: float | None) -> None:
    if max_aspect_ratio is not None and max(width, height) > max_aspect_ratio * min(width, height):
        raise ImageDecodeError(f"image is {width}x{height}: aspect ratio above {max_aspect_ratio:g}")


def train_transform(
    image_size: int, scale: tuple[float, float] = (0.9, 1.0), horizontal_flip: bool = False, **options: Any
) -> DecodeResizedCrop:
    """Random resized crop; no flip by default because captions say "left" and "right"."""
    return DecodeResizedCrop(image_size, scale, horizontal_flip=horizontal_flip, **options)


def eval_transform(image_size: int, **options: Any) -> DecodeResizedCrop:
    """Resize the shorter side to ``image_size`` and center crop (the usual eval protocol)."""
    return DecodeResizedCrop(image_size, None, **options)


class Normalize(torch.nn.Module):
    """uint8 (or float in [0, 1]) images -> float32 normalized with per-channel mean/std (0-1 units)."""

    def __init__(
        self, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD
    ) -> None:
        super().__init__()
        self.mean, self.std = list(mean), list(std)
        # Fold the /255 into the affine so one multiply and one add do the whole conversion.
        self.register_buffer("scale", 1.0 / (255.0 * torch.tensor(std).view(-1, 1, 1)), persistent=False)
        self.register_buffer(
            "shift", -torch.tensor(mean).view(-1, 1, 1) / torch.tensor(std).view(-1, 1, 1), persistent=False
        )

    def forward(self, images: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Normalized float32 images; ``out`` (optional): the tensor to write them into (same shape)."""
        # (B, D) precomputed image-tower features (a feature cache's), not pixels: nothing to normalize
        if images.dim() == 2:
            return images if out is None else out.copy_(images)
        if images.is_floating_point():
            normalized = v2.functional.normalize(images, self.mean, self.std)
            return normalized if out is None else out.copy_(normalized)
        scale, shift = self.scale.to(images.device), self.shift.to(images.device)
        if images.device.type == "cpu" and images.dim() == 4:
            # Image by image, so each (3, H, W) slice is converted, scaled and shifted while still in cache.
            out = torch.empty(images.shape, dtype=torch.float32) if out is None else out
            for target, image in zip(out, images, strict=True):
                target.copy_(image).mul_(scale).add_(shift)
            return out
        # In place on the fresh float copy, which is faster than addcmul writing another output.
        floats = images.to(torch.float32) if out is None else out.copy_(images)
        return floats.mul_(scale).add_(shift)
