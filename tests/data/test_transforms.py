"""Transforms: uint8 geometry, no flip unless asked, normalization equal to torchvision's, decode+crop in one step
equal in distribution and pixels to torchvision's RandomResizedCrop on a full decode."""

from __future__ import annotations

from importlib import resources
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp
from torchvision.transforms import v2

from mm_lightning.data.images import EncodedImage, ImageDecodeError, decode_image_bytes
from mm_lightning.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    DecodeResizedCrop,
    Normalize,
    eval_transform,
    train_transform,
)


def test_normalize_matches_torchvision() -> None:
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    reference = v2.functional.normalize(v2.functional.to_dtype(images, torch.float32, scale=True),
                                        list(IMAGENET_MEAN), list(IMAGENET_STD))  # fmt: skip
    ours = Normalize()(images)
    assert ours.dtype == torch.float32 and torch.allclose(ours, reference, atol=1e-5)
    assert torch.allclose(Normalize()(images.float() / 255), reference, atol=1e-5)  # float input: [0, 1]
    other = Normalize(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))(images)  # control: stats matter
    assert not torch.allclose(other, reference, atol=1e-2)


@pytest.mark.parametrize("size", [(50, 1000), (5, 7), (480, 640)])
def test_outputs_are_square_uint8(size: tuple[int, int]) -> None:
    image = torch.randint(0, 256, (3, *size), dtype=torch.uint8)
    for transform in (train_transform(32), eval_transform(32)):
        out = transform(image)
        assert out.shape == (3, 32, 32) and out.dtype == torch.uint8


def test_no_horizontal_flip_by_default() -> None:
    image = torch.zeros(3, 32, 32, dtype=torch.uint8)
    image[:, :, :16] = 255  # bright left half: a flip would move it right
    plain = train_transform(32, scale=(1.0, 1.0))
    assert all(plain(image)[:, :, :16].float().mean() > 200 for _ in range(20))
    flipping = train_transform(32, scale=(1.0, 1.0), horizontal_flip=True)  # control
    assert any(flipping(image)[:, :, :16].float().mean() < 50 for _ in range(40))


def test_eval_is_resize_shorter_side_then_center_crop() -> None:
    image = torch.zeros(3, 40, 80, dtype=torch.uint8)
    image[:, :, 20:60] = 255  # the central square is white, the sides black
    out = eval_transform(20)(image)
    assert out.shape == (3, 20, 20) and out.float().mean() > 250


# --- decode + crop in one step (DecodeResizedCrop) ------------------------------------------------------------


def _real_photo(name: str, size: tuple[int, int] = (640, 480)) -> Image.Image:
    """A camera photo shipped inside scikit-image's wheel (no download), resized like a COCO image."""
    path = resources.files("skimage") / "data" / name
    return Image.open(BytesIO(path.read_bytes())).convert("RGB").resize(size, Image.LANCZOS)


def _jpeg(image: Image.Image, **save: object) -> bytes:
    buf = BytesIO()
    image.save(buf, "JPEG", **save)
    return buf.getvalue()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().clamp_min(1e-10)
    return float(10 * torch.log10(255**2 / mse))


def _boxes(transform: DecodeResizedCrop | v2.RandomResizedCrop, size: tuple[int, int], seed: int, n: int):
    """``n`` crop boxes (top, left, height, width) for a ``size`` = (width, height) image."""
    torch.manual_seed(seed)
    placeholder = torch.zeros(3, size[1], size[0], dtype=torch.uint8)
    out = []
    for _ in range(n):
        if isinstance(transform, DecodeResizedCrop):
            out.append(transform.crop_box(*size))
        else:
            params = transform.make_params([placeholder])
            out.append((params["top"], params["left"], params["height"], params["width"]))
    return np.array(out, dtype=np.float64)


def _box_features(boxes: np.ndarray, size: tuple[int, int]) -> dict[str, np.ndarray]:
    top, left, h, w = boxes.T
    width, height = size
    return {
        "area": h * w / (width * height),
        "aspect": w / h,
        "top": (top + 0.5) / (height - h + 1),  # position within the free range, in (0, 1)
        "left": (left + 0.5) / (width - w + 1),
    }


@pytest.mark.parametrize(
    ("size", "scale", "ratio"),
    [
        ((640, 480), (0.08, 1.0), (3 / 4, 4 / 3)),
        ((640, 427), (0.9, 1.0), (3 / 4, 4 / 3)),  # the default: most draws end in the fallback
        ((1000, 50), (0.08, 1.0), (3 / 4, 4 / 3)),  # nothing fits: always the clamped fallback
        ((50, 1000), (0.08, 1.0), (3 / 4, 4 / 3)),
        ((500, 375), (0.3, 1.0), (0.5, 2.0)),
    ],
)
def test_crop_boxes_follow_torchvisions_procedure(size, scale, ratio) -> None:
    """Same distribution of area, aspect ratio, position and fallback as torchvision's sampler."""
    n = 1500
    ours = _boxes(DecodeResizedCrop(224, scale, ratio), size, seed=0, n=n)
    theirs = _boxes(v2.RandomResizedCrop(224, scale=scale, ratio=ratio), size, seed=1, n=n)
    fallback = [np.mean(_fallback_like(b, size, ratio)) for b in (ours, theirs)]
    assert abs(fallback[0] - fallback[1]) <= 4 * np.sqrt(0.25 / n) + 1e-9, fallback
    for name, a in _box_features(ours, size).items():
        b = _box_features(theirs, size)[name]
        if np.ptp(a) == 0 and np.ptp(b) == 0:
            assert a[0] == b[0], name  # deterministic (e.g. only the fallback is possible)
        else:
            assert ks_2samp(a, b).pvalue > 1e-3, name


def _fallback_like(boxes: np.ndarray, size: tuple[int, int], ratio: tuple[float, float]) -> np.ndarray:
    """Rows equal to torchvision's central fallback box."""
    width, height = size
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (boxes == np.array([(height - h) // 2, (width - w) // 2, h, w])).all(axis=1)


def test_crop_box_distribution_control() -> None:
    """The comparison above detects a different scale or ratio range, and boxes depend on the seed only."""
    size = (640, 480)
    theirs = _box_features(_boxes(v2.RandomResizedCrop(224, scale=(0.08, 1.0)), size, seed=1, n=1500), size)
    scale = _box_features(_boxes(DecodeResizedCrop(224, (0.3, 1.0)), size, seed=0, n=1500), size)
    assert ks_2samp(scale["area"], theirs["area"]).pvalue < 1e-6
    ratio = _box_features(_boxes(DecodeResizedCrop(224, (0.08, 1.0), (0.9, 1.1)), size, seed=0, n=1500), size)
    assert ks_2samp(ratio["aspect"], theirs["aspect"]).pvalue < 1e-6
    again = DecodeResizedCrop(224, (0.08, 1.0))
    assert np.array_equal(_boxes(again, size, seed=5, n=20), _boxes(again, size, seed=5, n=20))
    assert not np.array_equal(_boxes(again, size, seed=5, n=20), _boxes(again, size, seed=6, n=20))


@pytest.mark.parametrize("size", [(640, 480), (427, 640), (1000, 50)])
def test_plan_snaps_the_box_to_the_decode_scale_only(size: tuple[int, int]) -> None:
    ours = DecodeResizedCrop(224, (0.08, 1.0))
    for seed in range(50):
        torch.manual_seed(seed)
        box = ours.crop_box(*size)
        torch.manual_seed(seed)
        planned, scale = ours.plan(*size)
        assert max(abs(p - b) for p, b in zip(planned, box, strict=True)) <= scale


def test_crop_scale_distribution_equals_torchvision() -> None:
    def areas(transform: DecodeResizedCrop | v2.RandomResizedCrop, seed: int, n: int = 1500) -> np.ndarray:
        torch.manual_seed(seed)
        placeholder = torch.zeros(3, 480, 640, dtype=torch.uint8)
        out = []
        for _ in range(n):
            if isinstance(transform, DecodeResizedCrop):
                _, _, h, w = transform.plan(640, 480)[0]  # the box actually decoded, after snapping
            else:
                params = transform.make_params([placeholder])
                h, w = params["height"], params["width"]
            out.append(h * w / (640 * 480))
        return np.array(out)

    reference = areas(v2.RandomResizedCrop(64, scale=(0.08, 1.0)), seed=1)
    assert ks_2samp(areas(DecodeResizedCrop(64, (0.08, 1.0)), seed=2), reference).pvalue > 0.01
    control = areas(DecodeResizedCrop(64, (0.3, 1.0)), seed=2)  # a different scale range is detected
    assert ks_2samp(control, reference).pvalue < 1e-6


@pytest.mark.parametrize(
    ("photo", "save"),
    [("coffee.png", {}), ("chelsea.png", {"progressive": True}), ("astronaut.png", {"subsampling": 0})],
)
def test_scaled_decode_psnr_vs_full_decode_on_real_photos(photo: str, save: dict) -> None:
    data = _jpeg(_real_photo(photo), quality=90, **save)
    full = decode_image_bytes(data)
    ours, theirs = DecodeResizedCrop(160, (0.25, 1.0)), v2.RandomResizedCrop(160, scale=(0.25, 1.0))
    scales, same_box, unrelated = [], [], []
    for seed in range(8):
        torch.manual_seed(seed)
        box, scale = ours.plan(640, 480)
        scales.append(scale)
        torch.manual_seed(seed)
        out = ours(data)
        # Full decode + the same crop box + antialiased resize: only the decoder's DCT scaling differs.
        same_box.append(_psnr(out, v2.functional.resized_crop(full, *box, [160, 160], antialias=True)))
        torch.manual_seed(seed + 100)
        unrelated.append(_psnr(out, theirs(full)))  # control: another crop of the same photo
    assert min(scales) == 1 and max(scales) > 1  # both the full and the reduced decode were exercised
    assert min(same_box) >= 30
    assert np.median(unrelated) < 20


def test_eval_crop_psnr_vs_resize_center_crop() -> None:
    data = _jpeg(_real_photo("astronaut.png", (640, 480)), quality=90)
    reference = v2.Compose([v2.Resize(224, antialias=True), v2.CenterCrop(224)])(decode_image_bytes(data))
    ours = eval_transform(224)
    assert ours.plan(640, 480)[1] == 2  # 480 / 2 = 240 >= 224: decoded at half size
    assert _psnr(ours(data), reference) >= 30
    assert _psnr(eval_transform(224, reduced_decode=False)(data), reference) >= 30


def test_exif_rotated_photo_crops_like_the_upright_one(tmp_path: Path) -> None:
    upright = _real_photo("chelsea.png", (480, 640))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated; displayed after a 90 degree clockwise turn
    stored = upright.transpose(Image.Transpose.ROTATE_90)
    rotated, plain = _jpeg(stored, quality=95, exif=exif.tobytes()), _jpeg(upright, quality=95)
    transform = train_transform(128, scale=(0.3, 1.0))
    for seed in range(4):
        torch.manual_seed(seed)
        a = transform(rotated)
        torch.manual_seed(seed)
        b = transform(plain)
        assert _psnr(a, b) > 30
    torch.manual_seed(0)
    ignored = train_transform(128, scale=(0.3, 1.0))(_jpeg(stored, quality=95))  # control: no tag
    assert _psnr(a, ignored) < 20


def test_path_bytes_and_tensor_sources(tmp_path: Path) -> None:
    data = _jpeg(_real_photo("coffee.png", (320, 240)), quality=90)
    path = tmp_path / "c.jpg"
    path.write_bytes(data)
    transform = train_transform(64, scale=(0.5, 1.0), horizontal_flip=True)
    outs = []
    for source in (str(path), path, data, memoryview(data)):
        torch.manual_seed(3)
        outs.append(transform(source))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # A decoded tensor: the same box at full size (bytes decode at 1/2 size, the box snapped to its grid).
    from_tensor = DecodeResizedCrop(64, (0.5, 1.0), horizontal_flip=True, reduced_decode=False)
    psnr = []
    for seed in range(6):
        torch.manual_seed(seed)
        out = from_tensor(decode_image_bytes(data))
        torch.manual_seed(seed)
        psnr.append(_psnr(out, transform(data)))
    assert out.shape == (3, 64, 64) and np.median(psnr) > 30
    with pytest.raises(ImageDecodeError, match="not found"):
        transform(tmp_path / "missing.jpg")


def test_reduced_decode_off_decodes_full_size(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = EncodedImage.decode
    monkeypatch.setattr(
        EncodedImage, "decode", lambda self, scale=1: seen.append(scale) or original(self, scale)
    )
    data = _jpeg(_real_photo("coffee.png", (1280, 960)), quality=90)
    eval_transform(224)(data)
    eval_transform(224, reduced_decode=False)(data)
    assert seen == [4, 1]  # 960 / 4 = 240 >= 224
