"""Checks that a file is a complete checkpoint written by Lightning, and says what is wrong when it is not
(loaded when a run resumes or loads a checkpoint)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from mm_lightning import ExplainedError

# Keys every checkpoint written by Lightning's Trainer holds (Lightning's resume reads both).
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


class CheckpointFileError(ExplainedError, ValueError):
    """A checkpoint file that cannot be used; the message names the file and what is wrong with it."""


def check_checkpoint_file(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """Raise :class:`CheckpointFileError` unless ``path`` is a complete checkpoint written by Lightning.

    Returns the loaded dict. Cheap: zip files are memory-mapped, so tensors are not read.
    """
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise CheckpointFileError(f"Checkpoint {file} {what}.")
    size = file.stat().st_size
    if size == 0:
        raise CheckpointFileError(f"Checkpoint {file} is empty (0 bytes): an interrupted copy or save?")
    with open(file, "rb") as f:
        head = f.read(64)
    legacy = head.startswith(b"\x80")  # torch.save(..., _use_new_zipfile_serialization=False): a raw pickle
    if not head.startswith(b"PK\x03\x04") and not legacy:
        looks = "text" if _looks_like_text(head) else "binary data"
        raise CheckpointFileError(
            f"Checkpoint {file} is not a PyTorch checkpoint: it starts with {head[:16]!r} ({looks}), while"
            " torch.save writes a zip archive."
        )
    if not legacy and not zipfile.is_zipfile(file):
        raise CheckpointFileError(
            f"Checkpoint {file} is truncated or corrupt ({size} bytes, no zip index at its end): the save or"
            " copy was interrupted. Use an earlier checkpoint."
        )
    try:
        content = torch.load(file, map_location="cpu", weights_only=weights_only, mmap=not legacy)
    except Exception as err:  # noqa: BLE001 (torch raises several types for a damaged archive)
        raise CheckpointFileError(f"Checkpoint {file} cannot be loaded by torch.load: {err}") from err
    if not isinstance(content, dict):
        raise CheckpointFileError(
            f"Checkpoint {file} holds a {type(content).__name__}, not a Lightning checkpoint (a dict)."
        )
    missing = [key for key in LIGHTNING_KEYS if key not in content]
    if missing:
        keys = ", ".join(sorted(map(str, content))[:8]) or "none"
        raise CheckpointFileError(
            f"Checkpoint {file} is a PyTorch file but not a Lightning checkpoint: it lacks {missing} (its keys:"
            f" {keys}). To start from these weights, load them into the model (load_state_dict) instead of"
            " passing --ckpt_path."
        )
    return content


def _looks_like_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
