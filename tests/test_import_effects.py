"""Importing the package leaves the user's process as it was: PIL's decompression-bomb guard, the warnings
filters and the ``atexit`` handlers (``tests/import_effects.py`` imports every module and compares)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHANGES_EVERYTHING = """
import atexit, warnings
from PIL import Image
Image.MAX_IMAGE_PIXELS = None
warnings.filterwarnings("ignore", message="anything")
atexit.register(print)
"""


def import_effects(*modules: str, path: Path | None = None) -> dict[str, list[object]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), str(path or ""), env.get("PYTHONPATH", "")) if p
    )
    result = subprocess.run(
        [sys.executable, "tests/import_effects.py", *modules],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_importing_every_module_changes_nothing() -> None:
    assert import_effects() == {}


@pytest.mark.timeout(600)
def test_control_a_module_that_changes_the_process_is_caught(tmp_path: Path) -> None:
    (tmp_path / "changes_everything.py").write_text(CHANGES_EVERYTHING)
    changes = import_effects("changes_everything", path=tmp_path)
    assert changes["PIL.Image.MAX_IMAGE_PIXELS"] == [89_478_485, None]
    assert set(changes) == {"PIL.Image.MAX_IMAGE_PIXELS", "warnings.filters", "atexit handlers"}
    assert changes["atexit handlers"][1] == changes["atexit handlers"][0] + 1
