"""Checkpoint IO plugin: atomic, durable saves and loads that say what is wrong with a bad file.

The CLI installs it; in plain Python pass ``Trainer(plugins=[AtomicCheckpointIO()])``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from mm_lightning.errors import ExplainedError

_TMP_PREFIX = ".tmp-"
# Keys every checkpoint written by Lightning's Trainer holds (Lightning's resume reads both).
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


def is_local_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on the local filesystem (no ``s3://``-style protocol), as Lightning decides it."""
    return get_protocol(str(path)) == "file"


class CheckpointFileError(ExplainedError, ValueError):
    """A checkpoint file that cannot be used; the message names the file and what is wrong with it."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and durable and whose loads check the file first.

    Lightning's own save moves a file from the system temp dir (a copy across filesystems, not fsynced); here
    the fsynced temporary file sits in the target's folder, so the rename is atomic. Remote paths use
    Lightning's implementation. A bad local file fails to load with :class:`CheckpointFileError`.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically."""
        if storage_options is not None or not is_local_path(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)
        _remove_stale_temporaries(target)

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``path`` after checking it is a readable Lightning checkpoint (CheckpointFileError if not)."""
        if not is_local_path(path):
            return super().load_checkpoint(path, map_location, weights_only)
        check_checkpoint_file(path, weights_only=weights_only is not False)
        try:
            return super().load_checkpoint(path, map_location, weights_only)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointFileError(f"Checkpoint {path}: cannot be loaded: {err}") from err


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


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable (a crash right after os.replace could otherwise lose the new entry).
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(target: Path) -> None:
    # Temporaries of this target left behind by a process killed mid-save (SIGKILL runs no cleanup).
    for stale in target.parent.glob(f"{_TMP_PREFIX}{target.name}.*"):
        stale.unlink(missing_ok=True)
