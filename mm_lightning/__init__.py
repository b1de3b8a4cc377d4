"""mm_lightning: a PyTorch Lightning template for image-text (multimodal) training.

Run ``python -m mm_lightning fit --config configs/demo.yaml`` for the offline demo. The subpackages export their
public names lazily (PEP 562, :func:`lazy_exports`): each loads its module on first use, so a run loads only what
it touches. The project's own errors derive from :class:`ExplainedError` (how the command line prints them:
:mod:`mm_lightning.errors`).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

# every lazily exported name -> its public path, e.g. "SigLipLoss" -> "mm_lightning.models.losses.SigLipLoss"
PUBLIC_PATHS: dict[str, str] = {}


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name to its
    module."""
    PUBLIC_PATHS.update({name: f"{package}.{name}" for name in exports})

    def getattr_(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name]), name)

    def dir_() -> list[str]:
        return sorted(exports)

    return sorted(exports), getattr_, dir_


class ExplainedError(Exception):
    """Base of errors whose message says what is wrong and where: the CLI prints it without a traceback."""


__version__ = "0.1.0"
