"""Decoding: one test per image mode or defect, each on a file the test writes."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from mm_lightning.data.images import (
    EncodedImage,
    ImageDecodeError,
    decode_image_bytes,
    decode_image_file,
    read_image_bytes,
)
from tests.data.helpers import natural_array, save_image


def _reference(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def _check_rgb(x: torch.Tensor, size: tuple[int, int]) -> None:
    assert x.dtype == torch.uint8 and x.shape == (3, size[1], size[0])


def test_rgb_jpeg_fast_path_matches_pil(tmp_path: Path) -> None:
    path = save_image(tmp_path / "a.jpg", (64, 48), quality=95)
    x = decode_image_file(str(path))
    _check_rgb(x, (64, 48))
    # libjpeg-turbo in both: the IDCT may differ by a unit or two, never more.
    assert (x.int() - _reference(path).int()).abs().max() <= 3


def test_grayscale_jpeg(tmp_path: Path) -> None:
    path = tmp_path / "g.jpg"
    Image.fromarray(natural_array(30, 40)[..., 0]).save(path)
    x = decode_image_file(str(path))
    _check_rgb(x, (40, 30))
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])


def test_progressive_jpeg(tmp_path: Path) -> None:
    path = save_image(tmp_path / "p.jpg", (64, 48), progressive=True, quality=90)
    x = decode_image_file(str(path))
    _check_rgb(x, (64, 48))
    assert (x.int() - _reference(path).int()).abs().max() <= 3


def test_cmyk_jpeg(tmp_path: Path) -> None:
    path = tmp_path / "c.jpg"
    Image.fromarray(natural_array(40, 50)).convert("CMYK").save(path, quality=95)
    x = decode_image_file(str(path))
    _check_rgb(x, (50, 40))
    assert (x.int() - _reference(path).int()).abs().float().mean() < 2


def test_exif_orientation_applied(tmp_path: Path) -> None:
    path = tmp_path / "rot.jpg"
    img = Image.fromarray(natural_array(20, 60))  # landscape pixels
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": displayed image is portrait
    img.save(path, exif=exif.tobytes(), quality=95)
    x = decode_image_file(str(path))
    _check_rgb(x, (20, 60))


def test_palette_png_with_transparency_composited(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    img = Image.new("P", (10, 10))
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    img.paste(1, (0, 0, 5, 10))  # left half blue, right half red
    img.info["transparency"] = 0  # red index transparent
    img.save(path, transparency=0)
    x = decode_image_file(str(path), background=(255, 255, 255))
    _check_rgb(x, (10, 10))
    assert x[:, 0, 0].tolist() == [0, 0, 255]
    assert x[:, 0, 9].tolist() == [255, 255, 255]  # transparent -> background, not red or black


def test_rgba_png_composited_on_background(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    arr = np.zeros((8, 8, 4), dtype=np.uint8)  # fully transparent black...
    arr[:4, :, :] = (0, 200, 0, 255)  # ...except an opaque green top half
    Image.fromarray(arr, "RGBA").save(path)
    x = decode_image_file(str(path), background=(255, 255, 255))
    assert x[:, 0, 0].tolist() == [0, 200, 0]
    assert x[:, 7, 0].tolist() == [255, 255, 255]


def test_la_png(tmp_path: Path) -> None:
    path = tmp_path / "la.png"
    arr = np.stack([np.full((6, 6), 100, np.uint8), np.full((6, 6), 0, np.uint8)], axis=-1)
    arr[:3, :, 1] = 255
    Image.fromarray(arr, "LA").save(path)
    x = decode_image_file(str(path), background=(255, 255, 255))
    assert x[:, 0, 0].tolist() == [100, 100, 100] and x[:, 5, 0].tolist() == [255, 255, 255]


def test_l_png(tmp_path: Path) -> None:
    path = tmp_path / "l.png"
    Image.fromarray(np.full((5, 7), 77, np.uint8), "L").save(path)
    x = decode_image_file(str(path))
    _check_rgb(x, (7, 5))
    assert (x == 77).all()


def test_16bit_png_rescaled_not_clipped(tmp_path: Path) -> None:
    path = tmp_path / "g16.png"
    arr = np.linspace(0, 65535, 64, dtype=np.uint16).reshape(8, 8)
    Image.fromarray(arr).save(path)
    assert Image.open(path).mode.startswith("I")
    x = decode_image_file(str(path))
    _check_rgb(x, (8, 8))
    expected = torch.from_numpy((arr >> 8).astype(np.uint8))
    assert torch.equal(x[0], expected)  # a clip at 255 would make almost everything white


def test_1bit_png(tmp_path: Path) -> None:
    path = tmp_path / "b.png"
    img = Image.new("1", (9, 4), 0)
    img.putpixel((0, 0), 1)
    img.save(path)
    x = decode_image_file(str(path))
    _check_rgb(x, (9, 4))
    assert x[:, 0, 0].tolist() == [255, 255, 255] and x[:, 1, 1].tolist() == [0, 0, 0]


def test_animated_gif_first_frame(tmp_path: Path) -> None:
    path = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (6, 6), c) for c in ((250, 0, 0), (0, 0, 250))]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    x = decode_image_file(str(path))
    _check_rgb(x, (6, 6))
    assert x[0].float().mean() > 200 and x[2].float().mean() < 50


@pytest.mark.parametrize("size", [(7, 5), (1000, 50)])
def test_tiny_and_extreme_aspect(tmp_path: Path, size: tuple[int, int]) -> None:
    path = save_image(tmp_path / "x.jpg", size)
    _check_rgb(decode_image_file(str(path), min_side=224), size)


@pytest.mark.parametrize(
    ("min_side", "expected"), [(200, (320, 240)), (100, (160, 120)), (50, (80, 60)), (300, (640, 480))]
)
def test_reduced_size_jpeg_decode_keeps_min_side(
    tmp_path: Path, min_side: int, expected: tuple[int, int]
) -> None:
    path = save_image(tmp_path / "big.jpg", (640, 480), quality=90)
    x = decode_image_file(str(path), min_side=min_side)
    # 1/2 when 240 >= min_side, 1/4 when 120 >= min_side, 1/8 when 60 >= min_side
    _check_rgb(x, expected)
    ref = torch.nn.functional.interpolate(_reference(path)[None].float(), size=x.shape[1:], mode="area")[0]
    assert (x.float() - ref).abs().mean() < 4


def test_decompression_bomb_guard(tmp_path: Path) -> None:
    path = save_image(tmp_path / "bomb.png", (300, 200))
    with pytest.raises(ImageDecodeError, match="60000 pixels, above data.images.max_pixels=50000"):
        decode_image_file(str(path), max_pixels=50_000)
    _check_rgb(decode_image_file(str(path), max_pixels=60_000), (300, 200))


@pytest.mark.parametrize("suffix", ["png", "jpg", "tiff"])
def test_max_pixels_is_the_limit_and_pils_own_setting_is_left_as_it_was(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIL's process-wide guard (here set below the image's size) neither refuses nor warns about an image that
    ``max_pixels`` allows, and is the same after the decode."""
    path = save_image(tmp_path / f"big.{suffix}", (300, 200))
    monkeypatch.setattr(
        Image, "MAX_IMAGE_PIXELS", 20_000
    )  # 60000 pixels: above 2x, PIL alone would refuse it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_rgb(decode_image_file(str(path), max_pixels=None), (300, 200))
    assert Image.MAX_IMAGE_PIXELS == 20_000
    with pytest.raises(ImageDecodeError, match="above data.images.max_pixels=50000"):
        decode_image_file(str(path), max_pixels=50_000)
    assert Image.MAX_IMAGE_PIXELS == 20_000
    # control: PIL's own guard does fire on this file at this setting
    with pytest.raises(Image.DecompressionBombError):
        Image.open(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ImageDecodeError, match="not found"):
        decode_image_file(str(tmp_path / "nope.jpg"))


def test_zero_byte_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jpg"
    path.touch()
    with pytest.raises(ImageDecodeError, match="empty"):
        decode_image_file(str(path))


@pytest.mark.parametrize("min_side", [None, 16])  # full-size and reduced-decode path
@pytest.mark.parametrize("backend", ["simplejpeg", "pil"])
def test_truncated_jpeg(tmp_path: Path, min_side: int | None, backend: str) -> None:
    buf = io.BytesIO()
    Image.fromarray(natural_array(120, 160)).save(buf, "JPEG", quality=90)
    path = tmp_path / "trunc.jpg"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageDecodeError, match="truncated"):
        scale = 1 if min_side is None else 4
        EncodedImage(read_image_bytes(str(path)), backend=backend).decode(scale)  # type: ignore[arg-type]
    with pytest.raises(ImageDecodeError, match="truncated"):
        decode_image_file(str(path), min_side=min_side)


def test_non_image_with_image_extension(tmp_path: Path) -> None:
    path = tmp_path / "fake.jpg"
    path.write_text("<html>not an image</html>")
    with pytest.raises(ImageDecodeError, match="not a decodable image"):
        decode_image_file(str(path))


@pytest.mark.parametrize("backend", ["simplejpeg", "pil"])
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("scale", [1, 2])
def test_every_exif_orientation_matches_pil(
    tmp_path: Path, backend: str, orientation: int, scale: int
) -> None:
    path = tmp_path / "o.jpg"
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(natural_array(32, 48)).save(path, exif=exif.tobytes(), quality=95)
    pil = Image.open(path)
    pil.draft("RGB", (48 // scale, 32 // scale))  # the same DCT scaling, oriented by PIL's own code
    expected = torch.from_numpy(np.array(ImageOps.exif_transpose(pil.convert("RGB")))).permute(2, 0, 1)
    with EncodedImage(path.read_bytes(), backend=backend) as image:  # type: ignore[arg-type]
        assert image.size == (expected.shape[2] * scale, expected.shape[1] * scale)
        x = image.decode(scale)
    assert x.shape == expected.shape
    assert (x.float() - expected.float()).abs().mean() < 1.5
    unoriented = torch.from_numpy(np.array(pil.convert("RGB"))).permute(2, 0, 1)
    if orientation != 1:  # control: ignoring the tag gives another shape or very different pixels
        assert x.shape != unoriented.shape or (x.float() - unoriented.float()).abs().mean() > 10


@pytest.mark.parametrize("scale", [1, 2, 4, 8])
@pytest.mark.parametrize("save", [{}, {"progressive": True}, {"subsampling": 0}])
def test_backends_agree_at_every_scale(tmp_path: Path, scale: int, save: dict) -> None:
    path = save_image(tmp_path / "x.jpg", (203, 157), quality=90, **save)
    data = path.read_bytes()
    fast = EncodedImage(data, backend="simplejpeg").decode(scale)
    pil = EncodedImage(data, backend="pil").decode(scale)
    assert fast.shape == pil.shape == (3, -(-157 // scale), -(-203 // scale))
    assert (fast.float() - pil.float()).abs().mean() < 1.5


def test_scaled_cmyk_jpeg(tmp_path: Path) -> None:
    path = tmp_path / "c.jpg"
    Image.fromarray(natural_array(80, 96)).convert("CMYK").save(path, quality=95)
    x = EncodedImage(path.read_bytes()).decode(2)
    assert x.shape == (3, 40, 48)
    ref = torch.from_numpy(np.array(Image.open(path).convert("RGB").reduce(2))).permute(2, 0, 1)
    assert (x.float() - ref.float()).abs().mean() < 3


def test_bytes_entry_point_equals_file(tmp_path: Path) -> None:
    path = save_image(tmp_path / "b.jpg", (64, 48), quality=90)
    assert torch.equal(decode_image_bytes(path.read_bytes()), decode_image_file(path))
    assert torch.equal(decode_image_bytes(memoryview(path.read_bytes())), decode_image_file(str(path)))
    with pytest.raises(ImageDecodeError, match="empty"):
        decode_image_bytes(b"")
