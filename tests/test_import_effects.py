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


@pytest.mark.timeout(600)
def test_importing_every_module_changes_nothing_and_the_control_is_caught(tmp_path: Path) -> None:
    (tmp_path / "changes_everything.py").write_text(CHANGES_EVERYTHING)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "tests/import_effects.py", "changes_everything"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    changes = json.loads(result.stdout.strip().splitlines()[-1])
    assert changes["package"] == {}
    # control: a module that changes all three is caught
    control = changes["controls"]
    assert set(control) == {"PIL.Image.MAX_IMAGE_PIXELS", "warnings.filters", "atexit handlers"}
    assert control["PIL.Image.MAX_IMAGE_PIXELS"] == [89_478_485, None]
    assert control["atexit handlers"][1] == control["atexit handlers"][0] + 1
