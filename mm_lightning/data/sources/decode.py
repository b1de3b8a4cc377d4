"""Decode an image held in memory (a shard member) exactly like ``images.decode_image_file`` decodes a file.

``images.decode_image_bytes`` is that decoder where ``images.py`` has it; otherwise this adapter applies the
same guard and conversions to bytes (JPEG through torchvision's libjpeg-turbo decoder unless a reduced DCT
decode applies, everything else through PIL). Import it from here either way.
"""

from __future__ import annotations

from mm_lightning.data.images import ImageDecodeError

__all__ = ["ImageDecodeError", "decode_image_bytes"]

try:
    from mm_lightning.data.images import decode_image_bytes
except ImportError:  # images.py without a bytes entry point
    import io

    import torch
    from PIL import Image, ImageOps, UnidentifiedImageError
    from torchvision.io import ImageReadMode, decode_jpeg

    from mm_lightning.data.images import DEFAULT_MAX_PIXELS, _draft_scale, _pil_to_tensor, _to_rgb

    def decode_image_bytes(
        data: bytes,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        min_side: int | None = None,
        background: tuple[int, int, int] = (255, 255, 255),
    ) -> torch.Tensor:
        """Decode encoded image bytes to an RGB uint8 tensor (3, H, W).

        Args:
            data: the encoded image (JPEG, PNG, WebP, GIF, ...).
            max_pixels: refuse images whose header declares more pixels (decompression bombs); ``None``: no limit.
            min_side: allow JPEG decoding at 1/4 or 1/8 size while the shorter side stays at least this.
            background: RGB colour transparent pixels are composited on.

        Raises:
            ImageDecodeError: empty, truncated, unreadable or oversized image.
        """
        if not data:
            raise ImageDecodeError("image is empty (0 bytes)")
        try:
            with Image.open(io.BytesIO(data)) as img:  # header only
                width, height = img.size
                if max_pixels is not None and width * height > max_pixels:
                    raise ImageDecodeError(
                        f"image has {width}x{height}={width * height} pixels, above max_image_pixels={max_pixels} "
                        "(possible decompression bomb)"
                    )
                if img.format == "JPEG":
                    scale = _draft_scale(img.size, min_side)
                    if scale == 1:
                        return _decode_jpeg(data)
                    img.draft("RGB", (width // scale, height // scale))
                img.seek(0)
                img = ImageOps.exif_transpose(img)
                return _pil_to_tensor(_to_rgb(img, background))
        except ImageDecodeError:
            raise
        except UnidentifiedImageError as err:
            raise ImageDecodeError("not a decodable image (unknown or corrupt format)") from err
        except (OSError, SyntaxError, ValueError, RuntimeError, EOFError) as err:
            raise ImageDecodeError(f"corrupt or truncated image ({err})") from err

    def _decode_jpeg(data: bytes) -> torch.Tensor:
        try:
            return decode_jpeg(
                torch.frombuffer(bytearray(data), dtype=torch.uint8),
                mode=ImageReadMode.RGB,
                apply_exif_orientation=True,
            )
        except RuntimeError as err:
            reason = str(err).rsplit(",", 1)[-1].strip()
            raise ImageDecodeError(f"corrupt or truncated JPEG ({reason})") from err
