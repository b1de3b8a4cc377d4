"""Image transforms (``torchvision.transforms.v2``) that work on uint8 tensors, plus normalization.

Geometry runs on uint8 in the workers (4x less memory traffic than float); float conversion and
normalization run on the batch after transfer (see ``benchmarks/data_pipeline.py`` for the measurement), or
in the workers when ``normalize_on_device=False``.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(
    image_size: int,
    scale: tuple[float, float] = (0.9, 1.0),
    horizontal_flip: bool = False,
) -> v2.Compose:
    """Random resized crop; no flip by default because captions say "left" and "right".

    Args:
        image_size: output side.
        scale: area range of the random crop (open_clip's default 0.9-1.0 keeps caption content in view).
        horizontal_flip: add a random horizontal flip.
    """
    ops: list[v2.Transform] = [v2.RandomResizedCrop(image_size, scale=scale, antialias=True)]
    if horizontal_flip:
        ops.append(v2.RandomHorizontalFlip())
    return v2.Compose(ops)


def eval_transform(image_size: int) -> v2.Compose:
    """Resize the shorter side to ``image_size`` and center crop (the usual eval protocol).

    Args:
        image_size: output side.
    """
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


class Normalize(torch.nn.Module):
    """uint8 (or float in [0, 1]) images -> float32 normalized with per-channel mean/std.

    Args:
        mean: channel means in [0, 1] units.
        std: channel standard deviations in [0, 1] units.
    """

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

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.is_floating_point():
            return v2.functional.normalize(images, self.mean, self.std)
        scale, shift = self.scale.to(images.device), self.shift.to(images.device)
        # In place on the fresh float copy: 2.7x faster than addcmul's extra output (5.4 vs 14.6 ms per
        # 32x3x224x224 batch on one core).
        return images.to(torch.float32).mul_(scale).add_(shift)
