"""How the CLI reports the project's own errors: ``error: <Kind>: <message>`` plus the fix, exit code 1, no
traceback (``MM_LIGHTNING_TRACEBACK=1`` shows it). Any other exception keeps its traceback. Loaded when a
command fails."""

from __future__ import annotations

import os
import re

from lightning.fabric.utilities.exceptions import MisconfigurationException

from mm_lightning import ExplainedError

TRACEBACK_ENV = "MM_LIGHTNING_TRACEBACK"


def explained_error_names() -> set[str]:
    """Names of every ``ExplainedError`` class loaded so far (DataLoader workers load the same modules)."""
    names: set[str] = set()
    pending = [ExplainedError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending += cls.__subclasses__()
    return names


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
    """(kind, message) of a project error re-raised by a DataLoader worker, read from torch's RuntimeError."""
    text = str(err)
    caught = re.match(r"Caught (\w+) in DataLoader worker process \d+", text)
    if not caught or caught.group(1) not in explained_error_names():
        return None
    kind = caught.group(1)
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(rf"^(?:[\w.]+\.)?{kind}: (.*)$", lines[i])
        if found:
            return kind, "\n".join([found.group(1), *lines[i + 1 :]]).rstrip()
    return None


def cli_message(err: BaseException) -> str | None:
    """What the command line prints for ``err`` (``None``: not a project error, show a traceback)."""
    library_fix = next(
        (f for cls, text, f in LIBRARY_ERRORS if isinstance(err, cls) and text in str(err)), None
    )
    if isinstance(err, ExplainedError) or library_fix:
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
