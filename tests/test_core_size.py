"""The extras load only when a config names one, not in a one-step demo ``fit`` as shipped (its callbacks, its
worker, a validation batch); the size of what that fit loads is reported (README's "Where things are"), not capped
(``tests/core_size.py`` runs the fits in a fresh process and reports the loaded modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# modules outside the extras that a demo fit has no use for
OPT_IN = {
    "mm_lightning.commands.audit",
    "mm_lightning.commands.export",
    "mm_lightning.commands.zeroshot",
    "mm_lightning.evaluation.zeroshot",
    "mm_lightning.gloo_exit_abort",
    "mm_lightning.checkpoints.loading",
    "mm_lightning.errors",
    "mm_lightning.assets.demo_bert",
    "mm_lightning.models.towers.user_towers",
    "mm_lightning.logger_media",
}


@pytest.mark.timeout(300)
def test_a_one_step_demo_fit_loads_the_core_only(tmp_path: Path, record_property: Any) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "tests/core_size.py", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    core = loaded["core"]
    assert sorted(OPT_IN & set(core)) == []
    assert [name for name in core if name.startswith("mm_lightning.extras")] == []
    package = [len(path.read_text().splitlines()) for path in (REPO / "mm_lightning").rglob("*.py")]
    figure = f"{len(core)} of {len(package)} modules ({sum(core.values())} of {sum(package)} lines)"
    record_property("demo_fit_loads", figure)  # the figure README states (with -rA: printed)
    print(f"a one-step demo fit loads {figure}")
    # control: a run that names gradient caching loads it (with the extras package)
    assert "mm_lightning.extras.gradient_caching" in loaded["opt_in"]
