"""A package's public names, each imported from its module on first use (PEP 562), so importing the package
loads only what a run touches: ``from mm_lightning.data import ShardDataModule`` loads the shard modules, a run
on JSONL files never does."""

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
