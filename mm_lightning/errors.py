"""How the command line reports the project's own errors: the reason and the fix as the last lines, no traceback.

Errors raised for bad data, shards, checkpoints or a failed peer already name the file, line and reason; a
traceback in front of them (17-37 frames of Lightning and DataLoader internals) only buries that. ``python -m
mm_lightning`` prints ``error: <Kind>: <message>`` (plus what to do) and exits with code 1; set
``MM_LIGHTNING_TRACEBACK=1`` to get the full traceback instead. Any other exception keeps its traceback.
"""

from __future__ import annotations

import os
import re

from lightning.fabric.utilities.exceptions import MisconfigurationException

from mm_lightning.callbacks.nan_guard import NonFiniteTrainingError
from mm_lightning.callbacks.prediction import OutputFolderError
from mm_lightning.data.records import RecordError
from mm_lightning.data.samples import TooManyBadRecords
from mm_lightning.data.sources.shards import ShardError
from mm_lightning.data.splits import EmptySplitError, MissingTrainingFile, NoTrainingBatch
from mm_lightning.distributed import CollectiveError
from mm_lightning.models.losses.base import LossContractError
from mm_lightning.models.towers.base import UnknownModelError
from mm_lightning.models.towers.contract import TowerContractError
from mm_lightning.offline import PretrainedUnavailable
from mm_lightning.plugins.io import CheckpointFileError

TRACEBACK_ENV = "MM_LIGHTNING_TRACEBACK"
USER_ERRORS: tuple[type[BaseException], ...] = (
    RecordError,
    TooManyBadRecords,
    EmptySplitError,
    NoTrainingBatch,
    MissingTrainingFile,
    ShardError,
    CheckpointFileError,
    CollectiveError,
    NonFiniteTrainingError,
    OutputFolderError,
    TowerContractError,
    UnknownModelError,
    LossContractError,
    PretrainedUnavailable,
)
# what to do, for errors whose message says what is wrong but not how to go on
FIXES = {
    "RecordError": "Fix or remove that record, or skip bad records with --data.init_args.on_bad_record skip (each "
    "one counted and logged); `python -m mm_lightning audit --config <your config>` lists every bad record first.",
}


# Library errors whose message is clear but whose fix is ours to say: (type, part of the message, what to do).
LIBRARY_ERRORS: tuple[tuple[type[BaseException], str, str], ...] = (
    (
        MisconfigurationException,
        "No supported gpu backend found",
        "This machine has no GPU Lightning can use: for a CPU run pass --trainer.accelerator cpu"
        " --trainer.devices 1 (configs/demo.yaml and configs/lit.yaml are CPU recipes).",
    ),
    (
        TypeError,
        "`devices` selected with `CPUAccelerator` should be an int > 0",
        "On CPU, --trainer.devices is the number of processes: pass --trainer.devices 1 (or up to the CPU cores).",
    ),
)


def show_traceback() -> bool:
    """Whether the user asked for tracebacks (``MM_LIGHTNING_TRACEBACK`` set to anything but 0/empty)."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def _from_worker(err: BaseException) -> tuple[str, str] | None:
    """(kind, message) of a project error re-raised by a DataLoader worker (torch wraps it in a RuntimeError
    whose message holds the worker's traceback, ending in ``<module>.<Kind>: <message>``)."""
    text = str(err)
    caught = re.match(r"Caught (\w+) in DataLoader worker process \d+", text)
    names = {cls.__name__ for cls in USER_ERRORS}
    if not caught or caught.group(1) not in names:
        return None
    kind = caught.group(1)
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(rf"^(?:[\w.]+\.)?{kind}: (.*)$", lines[i])
        if found:
            return kind, "\n".join([found.group(1), *lines[i + 1 :]]).rstrip()
    return None


def cli_message(err: BaseException) -> str | None:
    """What the command line prints for ``err`` (``None``: not one of the project's errors, show a traceback)."""
    library_fix = next(
        (f for cls, text, f in LIBRARY_ERRORS if isinstance(err, cls) and text in str(err)), None
    )
    if isinstance(err, USER_ERRORS) or library_fix:
        kind, message = type(err).__name__, str(err)
    else:
        unwrapped = _from_worker(err)
        if unwrapped is None:
            return None
        kind, message = unwrapped
    fix = library_fix or FIXES.get(kind)
    lines = [f"error: {kind}: {message}"]
    if fix:
        lines.append(fix)
    lines.append(f"(set {TRACEBACK_ENV}=1 to see the traceback)")
    return "\n".join(lines)
