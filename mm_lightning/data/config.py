"""The data module's option groups, ``data.images`` and ``data.loader`` (option groups as the model's are:
:mod:`mm_lightning.option_groups`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mm_lightning.data.images import DEFAULT_MAX_PIXELS
from mm_lightning.option_groups import as_config, as_record

CaptionSampling = Literal["random", "all"]


@dataclass(frozen=True)
class ImageOptions:
    """``data.images``: how images are read, checked and prepared.

    Args:
        size: output side; null follows ``image_config`` (else 224); if set, it wins.
        mean: normalization mean per channel (0-1 units); null: the image tower's, else ImageNet's.
        std: normalization std per channel; null follows the image tower like ``mean``.
        train_scale: area range of the training random resized crop.
        horizontal_flip: random horizontal flips in training (off: captions say "left"/"right").
        max_pixels: refuse images above this many pixels (decompression bombs); null disables.
        confine_to_root: reject image paths (absolute, ``..``, links) that leave ``image_root``.
        reduced_decode: JPEGs decode at 1/2, 1/4 or 1/8 size when the crop needs no upsampling.
    """

    size: int | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    train_scale: tuple[float, float] = (0.9, 1.0)
    horizontal_flip: bool = False
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    confine_to_root: bool = False
    reduced_decode: bool = True


@dataclass(frozen=True)
class LoaderOptions:
    """``data.loader``: which pairs make the batches, and how.

    Args:
        caption_sampling: training: ``"random"`` (a caption per image per visit) or ``"all"`` pairs.
        max_replacements: under ``on_bad_record: skip``, bad candidates tried for one stand-in.
        pad_to_multiple_of: pad each batch's token length to a multiple of this (e.g. 8); null: no rounding.
        normalize_on: "device" (after transfer), "worker" (collate), "auto" (device in a Trainer).
        pin_memory: pin host memory for faster host-to-device copies.
        persistent_workers: keep workers between epochs.
        batch_slots: persistent workers stack images into a few reused shared-memory buffers (no effect without
            persistent workers).
        prefetch_factor: batches each worker prepares ahead (with ``num_workers > 0``; null: PyTorch's 2).
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"`` or null (the platform's default).
    """

    caption_sampling: CaptionSampling = "random"
    max_replacements: int = 64
    pad_to_multiple_of: int | None = None
    normalize_on: Literal["auto", "device", "worker"] = "auto"
    pin_memory: bool = False
    persistent_workers: bool = True
    batch_slots: bool = True
    prefetch_factor: int | None = None
    multiprocessing_context: str | None = None


DEFAULT_IMAGES = ImageOptions()
DEFAULT_LOADER = LoaderOptions()
OPTION_GROUPS = {"images": ImageOptions, "loader": LoaderOptions}


def recorded_options(options: dict[str, Any]) -> dict[str, Any]:
    """Data options with each group they have (``images``, ``loader``) as the plain dict of all its keys, as a
    checkpoint records them (a key left out is its default)."""
    groups = {
        name: as_record(as_config(cls, options[name], f"data.{name}"))
        for name, cls in OPTION_GROUPS.items()
        if name in options
    }
    return {**options, **groups}
