"""Checks that a file is a complete checkpoint written by Lightning, and says what is wrong when it is not; finds
a run's ``last``/``best`` checkpoint, says when a resume has nothing left to train (the limits a run reached:
:func:`further_limits`) and gives a file's SHA-256 (:func:`sha256_of`), which results and summaries name."""

from __future__ import annotations

import contextlib
import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from mm_lightning import ExplainedError

# Keys every checkpoint written by Lightning's Trainer holds (Lightning's resume reads both).
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


def sha256_of(path: str | os.PathLike) -> str:
    """The file's SHA-256 (hex): results name exactly the checkpoint they came from. A folder (a sharded
    checkpoint): one SHA-256 over its files' names and contents, in name order."""
    digest = hashlib.sha256()
    folder = Path(path).is_dir()
    for file in sorted(Path(path).iterdir()) if folder else [Path(path)]:
        if folder:
            digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as content:
            for block in iter(lambda content=content: content.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def further_limits(steps: int, epochs: int, max_steps: int, max_epochs: int) -> dict[str, int]:
    """The limits a run at ``steps`` / ``epochs`` has reached, each raised to run as long again."""
    reached = {}
    if max_steps >= 0 and steps >= max_steps:
        reached["steps"] = steps + max(max_steps, 1)
    if max_epochs >= 0 and epochs >= max_epochs:
        reached["epochs"] = epochs + max(max_epochs, 1)
    return reached


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


def replaced_copy(target: Path) -> Path:
    """Where a sharded save keeps the checkpoint it replaces, between its two renames."""
    return target.with_name(f".{target.name}.replaced")


def restore_replaced(target: Path) -> None:
    """Puts back the checkpoint a sharded save had moved aside when the save died between its two renames."""
    if not target.exists() and replaced_copy(target).is_dir():
        with contextlib.suppress(OSError):  # another process of the run put it back first
            os.replace(replaced_copy(target), target)


def run_checkpoint(name: str, folder: str | None, fresh_ok: bool) -> str | None:
    """The file ``--ckpt_path last`` or ``best`` names in the run's checkpoint folder.

    ``last``: ``last.ckpt``; ``best``: the one ``best*.ckpt``. None when ``fresh_ok`` and the run has no
    ``last.ckpt`` yet (a ``fit`` that starts fresh). Otherwise a missing file is a :class:`CheckpointFileError`
    naming where it looked and the run folders nearby that do hold checkpoints."""
    if folder and name == "last":
        restore_replaced(Path(folder) / "last.ckpt")
    found = sorted(Path(folder).glob("last.ckpt" if name == "last" else "best*.ckpt")) if folder else []
    if len(found) == 1:
        return str(found[0])
    if len(found) > 1:
        shown = ", ".join(path.name for path in found[:4])
        raise CheckpointFileError(
            f"{folder} holds {len(found)} best checkpoints ({shown}): pass the path of one."
        )
    if name == "last" and fresh_ok:
        return None
    raise CheckpointFileError(f"no {name} checkpoint in {folder}; {checkpoints_nearby(folder, cli=True)}")


def checkpoints_nearby(folder: str | os.PathLike | None, cli: bool = False) -> str:
    """Where checkpoints are, in words: the run folders under ``logs/`` and beside ``folder``'s run."""
    roots = {Path("logs")}
    if folder is not None:
        run_dir = Path(folder).parent if Path(folder).name == "checkpoints" else Path(folder)
        roots.add(run_dir.parent)
    found = sorted(
        {
            path.parent
            for root in roots
            for pattern in ("*/checkpoints/*.ckpt", "*/*.ckpt")
            for path in root.glob(pattern)
        }
    )
    if not found:
        return "no run folder with checkpoints under " + " or ".join(sorted(map(str, roots)))
    listed = [f"{path} ({', '.join(sorted(p.name for p in path.glob('*.ckpt'))[:3])})" for path in found[:6]]
    how = "give the run's --trainer.default_root_dir, or a path" if cli else "pass a checkpoint's path"
    return "checkpoints are in " + "; ".join(listed) + f" ({how})"


def nothing_left_to_train(
    content: dict[str, Any], max_steps: int | None, max_epochs: int | None, max_time: Any = None
) -> str | None:
    """Why resuming ``content`` would train no step under these limits (Lightning's own stop rule), or None."""
    steps = int(content.get("global_step", 0))
    fit_loop = (content.get("loops") or {}).get("fit_loop") or {}
    epochs = int((((fit_loop.get("epoch_progress") or {}).get("current") or {}).get("processed")) or 0)
    max_steps = -1 if max_steps is None else max_steps
    if max_epochs is None:  # Lightning's default: 1000 epochs unless max_steps or max_time is set
        max_epochs = 1000 if max_steps == -1 and max_time is None else -1
    reached = further_limits(steps, epochs, max_steps, max_epochs)
    if not reached:
        return None
    done = " and ".join(
        f"{count} {unit if count != 1 else unit[:-1]}"
        for unit, count in (("steps", steps), ("epochs", epochs))
        if unit in reached
    )
    limits = " and ".join(
        f"--trainer.max_{unit} {limit}"
        for unit, limit in (("steps", max_steps), ("epochs", max_epochs))
        if unit in reached
    )
    larger = " ".join(f"--trainer.max_{unit} {total}" for unit, total in reached.items())
    allow = "allow" if len(reached) > 1 else "allows"
    return (
        f"the run already trained {done}, as many as {limits} {allow}: nothing to train. Train further with a"
        f" larger total, e.g. {larger}"
    )
