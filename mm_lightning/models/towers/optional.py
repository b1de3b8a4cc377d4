"""Optional dependencies: import them with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"timm": "timm", "open_clip": "open_clip"}


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports ``module`` or raises an ImportError that says which extra installs it.

    Args:
        module: module to import (``timm``, ``open_clip``).
        extra: the package extra that provides it (``pip install "mm-lightning[<extra>]"``).
        feature: what needs it, for the message (e.g. ``"TimmTower"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"{feature} need the {module!r} package, which is not installed: "
            f'pip install "mm-lightning[{extra}]" (or pip install -e ".[{extra}]" in a checkout)'
        ) from err
