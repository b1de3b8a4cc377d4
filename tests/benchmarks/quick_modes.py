"""Every benchmark runs: ``python benchmarks/<name>.py --quick`` (the same code path as the full run, on tiny inputs,
in a temporary folder, without the development photos or a GPU) exits 0 and ends with its ``RESULT`` line. A script
added to ``benchmarks/`` is covered by being there; helpers that measure nothing live in ``benchmarks/support/``.
The scripts are run by two test files, a half of the alphabet each, so that two test processes share them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import preloaded
from tests.conftest import REPO

SCRIPTS = sorted((REPO / "benchmarks").glob("*.py"))
# run with --quick by a test of their own, which checks more than the RESULT line
OWN_TESTS = {
    "gpu_check.py": REPO / "tests" / "benchmarks" / "test_gpu_check.py",
    "recipes.py": REPO / "tests" / "benchmarks" / "test_recipes.py",
}


def scripts_from(first: str, last: str) -> list[Path]:
    """The scripts without a test of their own whose names start with a letter from ``first`` to ``last``."""
    return [s for s in SCRIPTS if s.name not in OWN_TESTS and first <= s.name[0].lower() <= last]


def quick_result(script: Path, timeout: float = 240) -> str:
    """The ``RESULT`` line of ``script --quick`` run in its own process (forked from preloaded Python); an ``AssertionError`` naming the script
    and the end of its output if it fails, hangs or ends otherwise."""
    try:
        done = preloaded.run([sys.executable, str(script), "--quick"], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{script.name} --quick ran past {timeout:g} s") from err
    output = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"{script.name} --quick exited {done.returncode}:\n{output}"
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith(f"RESULT {script.stem} "), (
        f"{script.name}: no RESULT line last:\n{output}"
    )
    return lines[-1]
