"""Image decoding: every mode users meet comes out as an RGB ``uint8`` tensor (3, H, W).
JPEGs use ``simplejpeg`` if installed (else PIL or torchvision) and may decode DCT-scaled; others use PIL."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_jpeg

try:
    import simplejpeg
except ImportError:  # optional accelerator: PIL and torchvision decode the same files, slower
    simplejpeg = None

DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own default limit (~ 0.25 GB of RGBA at 32 bit)
DCT_SCALES = (1, 2, 4, 8)  # the power-of-two reductions libjpeg's scaled IDCT offers
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_EXIF_ORIENTATION = 0x0112
Backend = Literal["auto", "simplejpeg", "pil"]
ImageSource = str | os.PathLike | bytes | bytearray | memoryview


class ImageDecodeError(ValueError):
    """An image file that cannot be turned into an RGB tensor; the message says why."""


def read_image_bytes(source: ImageSource) -> bytes | bytearray | memoryview:
    """The encoded bytes of ``source`` (a path, or bytes passed through), with clear errors for bad files."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = source
    else:
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as err:
            raise ImageDecodeError(f"image file not found or unreadable ({err.strerror})") from err
    if len(data) == 0:
        raise ImageDecodeError("image file is empty (0 bytes)")
    return data


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply an EXIF orientation (1-8) to a (C, H, W) tensor as views (no copy), like PIL's exif_transpose."""
    if orientation in (5, 6, 7, 8):
        image = image.transpose(-2, -1)
    flips = {2: [-1], 3: [-2, -1], 4: [-2], 6: [-1], 7: [-2, -1], 8: [-2]}.get(orientation)
    return image.flip(flips) if flips else image


_PIL_GUARD_LOCK = threading.RLock()


@contextmanager
def pil_guard_lifted() -> Iterator[None]:
    """PIL's bomb check off for one header read; ``max_pixels`` checks it (other threads go unchecked)."""
    with _PIL_GUARD_LOCK:
        previous = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = previous


class EncodedImage:
    """An encoded image opened header-only: displayed size first, pixels (optionally DCT-scaled) on demand.
    Raises :class:`ImageDecodeError` for an unreadable header or over ``max_pixels`` (``None``: no limit)."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        background: tuple[int, int, int] = (255, 255, 255),
        backend: Backend = "auto",
    ) -> None:
        self.data, self.background = data, background
        self.use_simplejpeg = simplejpeg is not None and backend != "pil"
        if backend == "simplejpeg" and simplejpeg is None:
            raise ImportError("backend='simplejpeg' needs the simplejpeg package (pip install simplejpeg)")
        with _decode_errors():
            with pil_guard_lifted():
                self._img = Image.open(io.BytesIO(data))  # lazy: reads the header only
            width, height = self._img.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageDecodeError(
                    f"image has {width}x{height}={width * height} pixels, above data.images.max_pixels={max_pixels} "
                    "(possible decompression bomb)"
                )
            self.is_jpeg = self._img.format == "JPEG"
            self.orientation = self._img.getexif().get(_EXIF_ORIENTATION, 1) if self.is_jpeg else 1
            if self.orientation not in range(1, 9):
                self.orientation = 1
        self._decoded: torch.Tensor | None = None
        if not self.is_jpeg:  # other formats may keep their EXIF after the pixels: decode now, size from that
            with _decode_errors():
                self._decoded = self._decode_pil(1)
            height, width = self._decoded.shape[-2:]
        self.size = (height, width) if self.orientation in (5, 6, 7, 8) else (width, height)
        """(width, height) as displayed, i.e. after EXIF orientation."""

    @property
    def scalable(self) -> bool:
        """Whether :meth:`decode` can reduce the size in the decoder (JPEG's DCT scaling)."""
        return self.is_jpeg

    def decode(self, scale: int = 1) -> torch.Tensor:
        """Decode to RGB uint8 (3, H, W) as displayed; JPEGs at ``ceil(side / scale)``, others full size."""
        if scale not in DCT_SCALES:
            raise ValueError(f"scale must be one of {DCT_SCALES}, got {scale}")
        if self._decoded is not None:
            return self._decoded
        with _decode_errors():
            if self._img.mode in ("RGB", "L") and self.use_simplejpeg:
                image = self._decode_simplejpeg(scale)
            elif self._img.mode in ("RGB", "L") and scale == 1:
                image = self._decode_torchvision()
            else:  # CMYK and other JPEG colour spaces, or scaled decoding without simplejpeg
                image = self._decode_pil(scale)
        return orient(image, self.orientation)

    def _decode_simplejpeg(self, scale: int) -> torch.Tensor:
        width, height = self._img.size
        # The smallest libjpeg scaling factor whose output is at least this large is exactly 1/scale.
        array = simplejpeg.decode_jpeg(
            self.data, "RGB", min_width=-(-width // scale), min_height=-(-height // scale)
        )
        return torch.from_numpy(array).permute(2, 0, 1)

    def _decode_torchvision(self) -> torch.Tensor:
        data = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=False)
        except RuntimeError as err:
            reason = str(err).rsplit(",", 1)[-1].strip()
            raise ImageDecodeError(f"corrupt or truncated JPEG ({reason})") from err

    def _decode_pil(self, scale: int) -> torch.Tensor:
        img = self._img
        if scale > 1:
            width, height = img.size
            img.draft(img.mode if img.mode == "CMYK" else "RGB", (width // scale, height // scale))
        with pil_guard_lifted():  # some formats (TIFF) check the size again when their pixels load
            img.seek(0)  # animated GIF/PNG/WebP: first frame
            if not self.is_jpeg:
                img = ImageOps.exif_transpose(img)
            array = np.array(_to_rgb(img, self.background), dtype=np.uint8)
        return torch.from_numpy(array).permute(2, 0, 1)

    def close(self) -> None:
        self._img.close()

    def __enter__(self) -> EncodedImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _decode_errors:
    """Turn the decoders' many exception types into one :class:`ImageDecodeError` with a reason."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> bool:
        if err is None or isinstance(err, ImageDecodeError):
            return False
        if isinstance(err, Image.DecompressionBombError):
            raise ImageDecodeError(f"image too large for PIL's own limit ({err})") from err
        if isinstance(err, UnidentifiedImageError):
            raise ImageDecodeError("not a decodable image (unknown or corrupt format)") from err
        if isinstance(err, (OSError, SyntaxError, ValueError, RuntimeError, EOFError)):
            raise ImageDecodeError(f"corrupt or truncated image ({err})") from err
        return False


def dct_scale_for(crop: tuple[int, int], out: tuple[int, int], allowed: tuple[int, ...] = DCT_SCALES) -> int:
    """Largest DCT scale at which a (width, height) crop still has at least ``out`` pixels (no upsampling)."""
    best = 1
    for scale in allowed:
        if crop[0] // scale >= out[0] and crop[1] // scale >= out[1]:
            best = max(best, scale)
    return best


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


def decode_image_bytes(
    data: bytes | bytearray | memoryview,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    min_side: int | None = None,
    background: tuple[int, int, int] = (255, 255, 255),
) -> torch.Tensor:
    """Decode one encoded image (e.g. a shard member) to RGB uint8 (3, H, W), or raise ImageDecodeError.
    ``min_side``: JPEGs may decode at 1/2, 1/4 or 1/8 size while the shorter side keeps that many pixels."""
    with EncodedImage(read_image_bytes(data), max_pixels, background) as image:
        scale = dct_scale_for(image.size, (min_side, min_side)) if min_side and image.scalable else 1
        return image.decode(scale).contiguous()


def decode_image_file(
    path: str | os.PathLike,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    min_side: int | None = None,
    background: tuple[int, int, int] = (255, 255, 255),
) -> torch.Tensor:
    """Decode one image file to an RGB uint8 tensor (3, H, W); see :func:`decode_image_bytes`."""
    return decode_image_bytes(read_image_bytes(path), max_pixels, min_side, background)
