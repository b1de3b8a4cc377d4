"""``--quick`` of the benchmarks from a to k (``quick_modes.py`` says what is checked), the control, and the scripts
that a test of their own runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_modes import OWN_TESTS, SCRIPTS, quick_result, scripts_from


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", scripts_from("a", "k"), ids=lambda s: s.stem)
def test_quick_mode_prints_its_result(script: Path) -> None:
    quick_result(script)


def test_every_script_is_run_by_one_of_the_two_halves_or_its_own_test() -> None:
    halves = scripts_from("a", "k") + scripts_from("l", "z")
    assert sorted(halves + [s for s in SCRIPTS if s.name in OWN_TESTS]) == SCRIPTS
    for script, test in OWN_TESTS.items():
        assert f'"benchmarks/{script}", "--quick"' in test.read_text(), test


def test_control_a_script_that_raises_or_prints_no_result_fails(tmp_path: Path) -> None:
    raises = tmp_path / "raises.py"
    raises.write_text(
        "import argparse\nargparse.ArgumentParser().add_argument('--quick')\nraise SystemExit(3)\n"
    )
    with pytest.raises(AssertionError, match="raises.py --quick exited 3"):
        quick_result(raises)
    silent = tmp_path / "silent.py"
    silent.write_text("print('RESULT other ratio=1')\nprint('done')\n")
    with pytest.raises(AssertionError, match="no RESULT line last"):
        quick_result(silent)
