"""The code base stays ruff-clean (lint rules and formatting from pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

PATHS = ["mm_lightning", "tests", "benchmarks", "examples"]


def test_ruff_check_and_format() -> None:
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *PATHS], cwd=REPO, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout[-3000:]
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *PATHS], cwd=REPO, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout[-3000:]
