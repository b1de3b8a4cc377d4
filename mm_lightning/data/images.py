"""Image decoding: every mode users meet comes out as a 3-channel RGB ``uint8`` tensor (3, H, W).

Fast path: baseline/progressive/CMYK JPEGs go through ``torchvision.io.decode_jpeg`` (libjpeg-turbo, EXIF
orientation applied). When the output is much smaller than the source, PIL's ``draft`` asks libjpeg for a
DCT-scaled (1/4, 1/8) decode, which skips most of the inverse DCT work; torchvision's decoder has no
scaled decode, so that is the one case PIL serves a JPEG. Everything else (PNG incl. 16-bit and palette
with transparency, GIF, 1-bit, LA/RGBA...) goes through PIL, with alpha composited on a background colour.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_jpeg

# Our own ``max_pixels`` guard runs on the header before any pixel is decoded; PIL's global guard would
# otherwise fire first with a different message (and only at 2x its limit).
Image.MAX_IMAGE_PIXELS = None

DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own default limit (~ 0.25 GB of RGBA at 32 bit)
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}


class ImageDecodeError(ValueError):
    """An image file that cannot be turned into an RGB tensor; the message says why."""


def _draft_scale(size: tuple[int, int], min_side: int | None) -> int:
    """Largest libjpeg DCT scale denominator (1, 4, 8) that keeps the shorter side >= ``min_side``.

    1/2 is not used: decode + crop through PIL at 1/2 measured within noise of torchvision's full decode
    (640x480 -> 224 px: 1.07x), while 1/4 and 1/8 win 1.2x (1280x960) and ~2x (2560x1920), best of 7
    alternating runs on one core (``benchmarks/data_pipeline.py`` prints these).
    """
    if not min_side:
        return 1
    short = min(size)
    scale = 1
    while scale < 8 and short // (scale * 2) >= min_side:
        scale *= 2
    return scale if scale >= 4 else 1


def _composite(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Flatten transparency onto ``background`` so transparent pixels do not become black garbage."""
    rgba = img.convert("RGBA")
    base = Image.new("RGBA", rgba.size, background + (255,))
    return Image.alpha_composite(base, rgba).convert("RGB")


def _to_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    has_alpha = img.mode in _ALPHA_MODES or (img.mode == "P" and "transparency" in img.info)
    if has_alpha:
        return _composite(img, background)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: PIL's convert("RGB") clips at 255 (turning most pixels white); rescale.
        arr = np.asarray(img, dtype=np.uint32)
        bits = 16 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 8
        arr8 = (arr >> (bits - 8)).astype(np.uint8)
        return Image.fromarray(arr8, mode="L").convert("RGB")
    if img.mode != "RGB":
        return img.convert("RGB")
    return img


def _pil_to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous()


def decode_image_file(
    path: str,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    min_side: int | None = None,
    background: tuple[int, int, int] = (255, 255, 255),
) -> torch.Tensor:
    """Decode one image file to an RGB uint8 tensor of shape (3, H, W).

    Args:
        path: image file path.
        max_pixels: refuse images whose header declares more pixels than this (decompression bombs);
            ``None`` disables the guard.
        min_side: if given, JPEGs may be decoded at 1/4 or 1/8 size as long as the shorter side stays at
            least this many pixels (the caller's transforms never need more).
        background: RGB colour that transparent pixels are composited on.

    Raises:
        ImageDecodeError: missing, empty, truncated, unreadable or oversized image; the message says which.
    """
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise ImageDecodeError(f"image file not found or unreadable ({err.strerror})") from err
    if size == 0:
        raise ImageDecodeError("image file is empty (0 bytes)")
    try:
        with Image.open(path) as img:  # lazy: reads the header only
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageDecodeError(
                    f"image has {width}x{height}={width * height} pixels, above max_image_pixels={max_pixels} "
                    "(possible decompression bomb)"
                )
            if img.format == "JPEG":
                scale = _draft_scale(img.size, min_side)
                if scale == 1:
                    return _decode_jpeg_fast(path)
                img.draft("RGB", (width // scale, height // scale))
            img.seek(0)  # animated GIF/PNG/WebP: first frame
            img = ImageOps.exif_transpose(img)
            return _pil_to_tensor(_to_rgb(img, background))
    except ImageDecodeError:
        raise
    except UnidentifiedImageError as err:
        raise ImageDecodeError("not a decodable image (unknown or corrupt format)") from err
    except (OSError, SyntaxError, ValueError, RuntimeError, EOFError) as err:
        raise ImageDecodeError(f"corrupt or truncated image ({err})") from err


def _decode_jpeg_fast(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as err:
        reason = str(err).rsplit(",", 1)[-1].strip()
        raise ImageDecodeError(f"corrupt or truncated JPEG ({reason})") from err
