"""Make it yours: callbacks composed from YAML alone, with the user's code in a folder outside the package."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests import preloaded
from tests.conftest import REPO, tiny_demo_args

EXAMPLE = REPO / "examples" / "make_it_yours"  # what the README shows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_user_callbacks_dropped_replaced_and_added_from_yaml(tmp_path: Path) -> None:
    user = tmp_path / "user_code"  # outside the package, on PYTHONPATH as a user's project would be
    user.mkdir()
    shutil.copy(EXAMPLE / "my_callbacks.py", user)
    listing = tmp_path / "callbacks.json"
    config = (EXAMPLE / "mine.yaml").read_text()
    assert "logs/callbacks.json" in config
    (user / "mine.yaml").write_text(config.replace("logs/callbacks.json", str(listing)))
    args = [*tiny_demo_args(tmp_path / "run", max_steps=2), "--config", str(user / "mine.yaml")]
    args += ["--trainer.limit_val_batches", "0"]
    env = {**os.environ, "PYTHONPATH": f"{user}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = preloaded.run(
        [sys.executable, "-m", "mm_lightning", "fit", *args], capture_output=True, timeout=240, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = json.loads(listing.read_text())
    assert "CallbackList" in names and "MyLearningRateMonitor" in names
    assert "NaNGuard" not in names and "LearningRateMonitor" not in names
    assert not any("ModelSummary" in name for name in names)  # Lightning's own summary is off too
    assert {"ModelCheckpoint", "ThroughputLogger", "PreemptionCheckpoint", "ExactResume"} <= set(names)
