"""What a hostile checkpoint names: a function that leaves a marker file when it is called (its path in the
``HOSTILE_MARKER`` environment variable), standing for any command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def leave_marker(*args: Any, **kwargs: Any) -> None:
    Path(os.environ["HOSTILE_MARKER"]).touch()
