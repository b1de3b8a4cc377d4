"""``--quick`` of the benchmarks from l to z (``quick_modes.py`` says what is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_modes import quick_result, scripts_from


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", scripts_from("l", "z"), ids=lambda s: s.stem)
def test_quick_mode_prints_its_result(script: Path) -> None:
    quick_result(script)
