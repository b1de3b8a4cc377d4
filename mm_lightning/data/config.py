"""The data module's option groups, ``data.images`` and ``data.loader``, with their defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from mm_lightning.data.images import DEFAULT_MAX_PIXELS

CaptionSampling = Literal["random", "all"]


class ImageOptions(TypedDict, total=False):
    """``data.images``: how images are read, checked and prepared (unset keys: :data:`IMAGE_DEFAULTS`).

    Args:
        size: output side; null follows ``image_config`` (else 224); if set, it wins.
        mean: normalization mean per channel (0-1 units); null: the image tower's, else ImageNet's.
        std: normalization std per channel; null follows the image tower like ``mean``.
        train_scale: area range of the training random resized crop (default 0.9-1.0).
        horizontal_flip: random horizontal flips in training (default off: captions say "left"/"right").
        max_pixels: refuse images above this many pixels (decompression bombs); null disables.
        confine_to_root: reject image paths (absolute, ``..``, links) that leave ``image_root`` (default off).
        reduced_decode: JPEGs decode at 1/2, 1/4 or 1/8 size when the crop needs no upsampling (default on).
    """

    size: int | None
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    train_scale: tuple[float, float]
    horizontal_flip: bool
    max_pixels: int | None
    confine_to_root: bool
    reduced_decode: bool


class LoaderOptions(TypedDict, total=False):
    """``data.loader``: which pairs make the batches, and how (unset keys: :data:`LOADER_DEFAULTS`).

    Args:
        caption_sampling: training: ``"random"`` (default: a caption per image per visit) or ``"all"`` pairs.
        max_replacements: under ``on_bad_record: skip``, bad candidates tried for one stand-in (default 64).
        pad_to_multiple_of: pad each batch's token length to a multiple of this (e.g. 8); null: no rounding.
        normalize_on: "device" (after transfer), "worker" (collate), "auto" (default: device in a Trainer).
        pin_memory: pin host memory for faster host-to-device copies (default off).
        persistent_workers: keep workers between epochs (default on).
        batch_slots: persistent workers stack images into a few reused shared-memory buffers (default on;
            no effect without persistent workers).
        prefetch_factor: batches each worker prepares ahead (with ``num_workers > 0``; null: PyTorch's 2).
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"`` or null (the platform's default).
    """

    caption_sampling: CaptionSampling
    max_replacements: int
    pad_to_multiple_of: int | None
    normalize_on: Literal["auto", "device", "worker"]
    pin_memory: bool
    persistent_workers: bool
    batch_slots: bool
    prefetch_factor: int | None
    multiprocessing_context: str | None


IMAGE_DEFAULTS = ImageOptions(
    size=None,
    mean=None,
    std=None,
    train_scale=(0.9, 1.0),
    horizontal_flip=False,
    max_pixels=DEFAULT_MAX_PIXELS,
    confine_to_root=False,
    reduced_decode=True,
)
LOADER_DEFAULTS = LoaderOptions(
    caption_sampling="random",
    max_replacements=64,
    pad_to_multiple_of=None,
    normalize_on="auto",
    pin_memory=False,
    persistent_workers=True,
    batch_slots=True,
    prefetch_factor=None,
    multiprocessing_context=None,
)
OPTION_GROUPS = {"images": IMAGE_DEFAULTS, "loader": LOADER_DEFAULTS}


def with_group_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """Data options with each group they have (``images``, ``loader``) filled in from its defaults.

    Raises:
        TypeError: a group has a key it does not know (an error, not a silently ignored option)."""
    filled = {}
    for group, defaults in OPTION_GROUPS.items():
        if group in options:
            given = options[group] or {}
            if unknown := sorted(set(given) - set(defaults)):
                raise TypeError(
                    f"data.{group}: unknown option(s) {unknown}; the options are {sorted(defaults)}"
                )
            filled[group] = {**defaults, **given}
    return {**options, **filled}
