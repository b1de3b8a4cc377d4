"""Transforms: uint8 geometry, no flip unless asked, normalization equal to torchvision's."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from mm_lightning.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
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
