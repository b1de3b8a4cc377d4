"""``export --format sentence-transformers``: the cases of ``sentence_transformers_cases.py``, in a pytest process of
their own (see there why)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("sentence_transformers_cases.py")


@pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None, reason="sentence-transformers")
@pytest.mark.timeout(300)
def test_a_lit_checkpoint_exports_as_a_sentence_transformer_and_reloads_offline(tmp_path: Path) -> None:
    pytest_in_its_own_process = [
        sys.executable,
        "-m",
        "pytest",
        str(CASES),
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
    ]
    result = subprocess.run(
        [*pytest_in_its_own_process, "--basetemp", str(tmp_path)], capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert "\n3 passed" in result.stdout  # every case ran
