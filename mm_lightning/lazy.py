"""A package's public names, each imported from its module on first use (PEP 562), so importing the package
loads only what a run touches: ``from mm_lightning.data import ShardDataModule`` loads the shard modules, a run
on JSONL files never does. On the command line a built-in class's short name becomes its path
(:func:`expand_short_names`), since LightningCLI resolves short names among the classes loaded so far."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

# every lazily exported name -> its public path, e.g. "SigLipLoss" -> "mm_lightning.models.losses.SigLipLoss"
PUBLIC_PATHS: dict[str, str] = {}


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name to its module."""
    PUBLIC_PATHS.update({name: f"{package}.{name}" for name in exports})

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name]), name)

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_


def expand_short_names(args: list[str]) -> list[str]:
    """A built-in class named by its short name on the command line (``--model.image_tower TimmTower``) becomes its
    path: LightningCLI resolves short names among the classes already loaded, and a built-in part loads only when
    a run names it. (In a config file, give the path: ``class_path: mm_lightning.models.towers.TimmTower``.)"""
    out = list(args)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if eq and takes_a_class(key) and value in PUBLIC_PATHS:
            out[i] = f"{key}={PUBLIC_PATHS[value]}"
        elif i and takes_a_class(args[i - 1]) and arg in PUBLIC_PATHS:
            out[i] = PUBLIC_PATHS[arg]
    return out


CLASS_OPTIONS = {"model.image_tower", "model.text_tower", "model.loss", "trainer.strategy", "trainer.callbacks",
                 "trainer.plugins", "trainer.logger"}  # fmt: skip


def takes_a_class(flag: str) -> bool:
    """Whether the command-line option ``flag`` names a class: a part, a callback group (``--nan_guard``),
    ``--data`` or a ``class_path``; a plain value (a run name, a file) is never rewritten."""
    name = flag[2:].rstrip("+") if flag.startswith("--") else ""
    return name in CLASS_OPTIONS or name.endswith(".class_path") or (name.isidentifier() and name != "config")
