"""Sharded checkpoints: a folder written by torch's distributed checkpoint (DCP) plus Lightning's ``meta.pt``,
read as data.

torch's reader unpickles ``.metadata`` with a plain ``pickle.load`` and its planner reads the non-tensor entries
(an optimizer's ``lr``, ``betas``) with ``torch.load(weights_only=False)``: a crafted folder runs code on load.
Here ``.metadata`` goes through an unpickler that admits only DCP's own metadata classes, the non-tensor entries
and ``meta.pt`` are read with ``weights_only=True``, and the folder may hold nothing but DCP's files and
``meta.pt``. A sharded checkpoint loads on any number of processes (DCP reshards), or in one process as one
state dict (:func:`read_sharded_checkpoint`, for the commands)."""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from typing_extensions import override

from mm_lightning.checkpoints.files import CheckpointFileError

METADATA_FILE = ".metadata"  # DCP's index of every entry and where its bytes are
META_FILE = (
    "meta.pt"  # Lightning's: what is not a tensor of the model or the optimizer (loops, callbacks, ...)
)
# meta.pt's list of the 0-d parameters saved with one element (fully_shard cannot split a 0-d tensor)
RESHAPED_KEY = "one_element_parameters"
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # one per writing process
# the globals DCP's metadata pickle holds (torch 2.4 to 2.14): its dataclasses, torch.Size, dtypes, layouts, paths
METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
            "MetadataIndex",
            "StorageMeta",
        )
    ),  # fmt: skip
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class ShardedCheckpointError(CheckpointFileError):
    """A sharded checkpoint folder that is refused; the message names the file and why."""


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is to be read as a sharded checkpoint: any folder (:func:`check_folder` says what is
    wrong with one that is not)."""
    return Path(path).is_dir()


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ShardedCheckpointError(
            f"Checkpoint {self.source} refers to {module}.{name}, which a sharded checkpoint's index never holds:"
            " refused, since loading it could run code."
        )


def read_metadata(folder: str | os.PathLike) -> Metadata:
    """The folder's DCP index, read by an unpickler that admits only DCP's metadata classes; every entry must
    point into one of the folder's shard files."""
    root = Path(folder)
    check_folder(root)
    source = root / METADATA_FILE
    try:
        with open(source, "rb") as file:
            metadata = _MetadataUnpickler(file, source).load()
    except ShardedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 (a damaged pickle raises several types)
        raise ShardedCheckpointError(f"Checkpoint {source} cannot be read: {err}") from err
    if not isinstance(metadata, Metadata):
        raise ShardedCheckpointError(
            f"Checkpoint {source} holds a {type(metadata).__name__}, not DCP's Metadata."
        )
    if not isinstance(metadata.storage_data or {}, dict):
        raise ShardedCheckpointError(f"Checkpoint {source}: its index has no table of where entries are.")
    for index, info in (metadata.storage_data or {}).items():
        relative = getattr(info, "relative_path", None)
        if (
            not isinstance(relative, str)
            or not SHARD_FILE.fullmatch(relative)
            or not (root / relative).is_file()
        ):
            raise ShardedCheckpointError(
                f"Checkpoint {source}: entry {getattr(index, 'fqn', index)!r} points to {relative!r}, not a shard"
                f" file of {root}."
            )
    return metadata


def check_folder(folder: Path) -> None:
    """Refuse a folder that is not a complete sharded checkpoint or holds files DCP and Lightning do not write."""
    if not folder.is_dir():
        raise ShardedCheckpointError(f"Checkpoint {folder} is not a folder.")
    entries = sorted(folder.iterdir())
    names = [entry.name for entry in entries]
    for required in (METADATA_FILE, META_FILE):
        if required not in names:
            raise ShardedCheckpointError(
                f"Checkpoint {folder} lacks {required}: the save was interrupted, or it is not a sharded checkpoint"
                " written by Lightning."
            )
    # a link or a device could point a shard outside the folder or make a read never end
    odd = [entry.name for entry in entries if entry.is_symlink() or not entry.is_file()]
    if odd:
        raise ShardedCheckpointError(
            f"Checkpoint {folder} holds {odd[:3]}, which are not plain files: refused (a sharded checkpoint's files"
            " are written in the folder itself)."
        )
    foreign = [
        name for name in names if name not in (METADATA_FILE, META_FILE) and not SHARD_FILE.fullmatch(name)
    ]
    if foreign:
        raise ShardedCheckpointError(
            f"Checkpoint {folder} holds {foreign[:3]}, which a sharded checkpoint never holds: refused."
        )


def read_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """Lightning's ``meta.pt`` of the folder (loops, callbacks, hyperparameters), read with ``weights_only=True``."""
    source = Path(folder) / META_FILE
    try:
        meta = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (torch raises several types for a refused or damaged file)
        raise ShardedCheckpointError(f"Checkpoint {source} cannot be loaded as data: {err}") from err
    if not isinstance(meta, dict):
        raise ShardedCheckpointError(
            f"Checkpoint {source} holds a {type(meta).__name__}, not Lightning's dict."
        )
    return meta


def checked_meta(folder: str | os.PathLike) -> dict[str, Any]:
    """``meta.pt`` of a folder whose files, index and non-tensor entries are checked (what a resume reads before
    the shards: a strategy may then read them with torch's own reader, which finds only checked values)."""
    read_entries(folder, "", tensors=False)
    meta = read_meta(folder)
    if "pytorch-lightning_version" not in meta:
        raise ShardedCheckpointError(
            f"Checkpoint {folder} is not a Lightning checkpoint: its meta.pt has no version."
        )
    return meta


class CheckedReader(FileSystemReader):
    """DCP's file reader whose index is read by :func:`read_metadata`; a rank's own index is never read."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ShardedCheckpointError(f"Checkpoint {self.path}: per-rank indexes are not read.")
        metadata = read_metadata(self.path)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner whose non-tensor entries are read with ``weights_only=True``."""

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            entry = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001
            raise ShardedCheckpointError(
                f"Checkpoint entry {read_item.dest_index.fqn!r} cannot be loaded as data: {err}"
            ) from err
        data = io.BytesIO()
        torch.save(entry, data)  # what the base class stores, from checked values only
        data.seek(0)
        super().load_bytes(read_item, data)


def load_sharded(state: dict[str, Any], folder: str | os.PathLike, strict: bool = True) -> None:
    """Fill ``state`` (DCP's stateful form: model and optimizer state dicts) in place from ``folder``, resharded
    to this run's processes."""
    _checked_dcp_load(state, folder, CheckedLoadPlanner(allow_partial_load=not strict))


def _checked_dcp_load(
    state: dict[str, Any], folder: str | os.PathLike, planner: CheckedLoadPlanner, **options: Any
) -> None:
    read_metadata(folder)  # refused here in one line: DCP would wrap the refusal in its own report
    try:
        dcp.load(state, storage_reader=CheckedReader(folder), planner=planner, **options)
    except dcp.CheckpointException as err:
        for failure, _ in err.failures.values():
            if isinstance(failure, ShardedCheckpointError):
                raise failure from None
        raise


def read_entries(folder: str | os.PathLike, prefix: str, tensors: bool = True) -> dict[str, Any]:
    """Every entry of the folder whose flattened name starts with ``prefix`` (``state_dict.``,
    ``optimizer_0.state.``), whole, in one process: tensors (unless ``tensors`` is false) and checked values."""
    metadata = read_metadata(folder)
    state: dict[str, Any] = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        if isinstance(entry, TensorStorageMetadata)
        else None
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and (tensors or not isinstance(entry, TensorStorageMetadata))
    }
    with warnings.catch_warnings():  # one process on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _checked_dcp_load(state, folder, CheckedLoadPlanner(), no_dist=True)
    return state


def read_sharded_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    """The whole checkpoint in one process, shaped as a single-file one: ``meta.pt`` and the model's full
    ``state_dict`` (the optimizer's state is left out)."""
    checkpoint = checked_meta(folder)
    prefix = "state_dict."
    weights = {key[len(prefix) :]: value for key, value in read_entries(folder, prefix).items()}
    for name in checkpoint.pop(RESHAPED_KEY, []):
        if name in weights and weights[name].numel() == 1:
            weights[name] = weights[name].reshape(())
    checkpoint["state_dict"] = weights
    return checkpoint
