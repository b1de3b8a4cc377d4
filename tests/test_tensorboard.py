"""TensorBoard: the tiny run's event files hold the documented scalars, and a real server serves them."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import TinyRun

EXPECTED_TAGS = [
    "train/loss",
    "train/loss_itc",
    "train/loss_itm",
    "train/temperature",
    "val/loss",
    "val/r1_t2i",
    "val/r1_i2t",
    "val/r5_t2i",
    "val/r5_i2t",
    "val/r10_t2i",
    "val/r10_i2t",
]


def _scalars(log_dir: Path) -> dict[str, list[float]]:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_event_files_hold_expected_finite_scalars(tiny_run: TinyRun) -> None:
    scalars = _scalars(tiny_run.log_dir)
    missing = [tag for tag in EXPECTED_TAGS if tag not in scalars]
    assert not missing, f"missing tags {missing}; present: {sorted(scalars)}"
    for tag in EXPECTED_TAGS:
        assert scalars[tag] and all(math.isfinite(v) for v in scalars[tag]), tag
    assert len(scalars["train/loss"]) >= 5  # logged every step (log_every_n_steps=1, 6 steps)
    assert len(scalars["val/r1_t2i"]) == 2  # validation at steps 3 and 6
    assert all(0.0 <= v <= 1.0 for v in scalars["val/r1_t2i"])
    lr_tags = [tag for tag in scalars if tag.startswith("lr-")]
    assert lr_tags, f"no learning-rate scalars; present: {sorted(scalars)}"
    throughput = [tag for tag in scalars if "samples_per_sec" in tag]
    assert throughput and all(v > 0 for v in scalars[throughput[0]])
    assert (tiny_run.log_dir / "config.yaml").is_file(), "the run's config must be saved next to its logs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_tensorboard_server_serves_a_scalar_series(tiny_run: TinyRun) -> None:
    port = _free_port()
    logdir = tiny_run.log_dir.parent
    run = tiny_run.log_dir.name
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    query = urllib.parse.urlencode({"tag": "train/loss", "run": run})
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
    series = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and series is None:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    body = json.loads(response.read())
                    series = body or None
            except (OSError, ValueError):
                pass
            if series is None:
                time.sleep(0.5)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert series is not None, f"tensorboard never served train/loss for run {run!r}"
    expected = _scalars(tiny_run.log_dir)["train/loss"]
    # Each point is [wall_time, step, value]; the server must return the same values the event file holds.
    assert [point[2] for point in series] == pytest.approx(expected, rel=1e-6)
