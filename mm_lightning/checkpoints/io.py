"""Checkpoint IO plugin: atomic, durable saves and loads that say what is wrong with a bad file.
The CLI installs it; in plain Python pass ``Trainer(plugins=[AtomicCheckpointIO()])``."""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

_TMP_PREFIX = ".tmp-"


def is_local_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on the local filesystem (no ``s3://``-style protocol), as Lightning decides it."""
    return get_protocol(str(path)) == "file"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and durable and whose loads check the file first.

    Lightning's save moves an unsynced file from the system temp dir (a copy across filesystems); here an
    fsynced temporary in the target's folder is renamed atomically; remote paths use Lightning's own."""

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
        fsync_dir(target.parent)
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
        from mm_lightning.checkpoints.files import CheckpointFileError, check_checkpoint_file
        from mm_lightning.checkpoints.sharded import is_sharded_checkpoint, read_sharded_checkpoint

        if is_sharded_checkpoint(
            path
        ):  # one process reads the whole model (no optimizer: test, predict, ...)
            return read_sharded_checkpoint(path)
        check_checkpoint_file(path, weights_only=weights_only is not False)
        try:
            return super().load_checkpoint(path, map_location, weights_only)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointFileError(f"Checkpoint {path}: cannot be loaded: {err}") from err


def fsync_dir(directory: Path) -> None:
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
