"""A signal to the whole process group (a terminal's Ctrl-C, ``kill -- -PGID``, ``timeout``) with loader workers
running: ``last.ckpt`` is saved after the current batch, the run exits with 0, no worker traceback, no process
left behind. A second Ctrl-C stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from mm_lightning.extras import PreemptionCheckpoint
from tests import preloaded
from tests.conftest import REPO, tiny_demo_args
from tests.resilience.test_checkpointing import wait_for


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generated demo dataset for the runs of this module."""
    return tmp_path_factory.mktemp("group_signals") / "demo"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_process_group_saves_and_exits_cleanly(
    tmp_path: Path, demo_data: Path, signum: signal.Signals
) -> None:
    markers = {
        "class_path": "tests.resilience.train_script.StepMarkers",
        "init_args": {"root": str(tmp_path), "sleep": 0.05},
    }
    args = tiny_demo_args(
        tmp_path,
        "--data.init_args.num_workers", "2",
        "--trainer.max_epochs", "3",
        "--trainer.callbacks+", json.dumps(markers),
        max_steps=-1,
        callbacks={"checkpoint": {"every_n_train_steps": 1000}},  # any last.ckpt comes from the signal
    )  # fmt: skip
    args[args.index("--data.init_args.data_dir") + 1] = str(demo_data)
    log = tmp_path / "run.log"
    with log.open("w") as sink:
        process = preloaded.popen(
            [sys.executable, "-m", "mm_lightning", "fit", *args], stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    wait_for(tmp_path / "step3", process, log=log)
    workers = psutil.Process(process.pid).children()
    assert len(workers) >= 2  # training (and validation) loader workers
    os.killpg(
        process.pid, signum
    )  # the process group the run was started in, as a terminal or `timeout` does
    process.wait(timeout=120)
    output = log.read_text()

    assert process.returncode == 0, output[-5000:]
    assert f"Received {signum.name}: saved" in output
    assert "killed by signal" not in output and "Traceback" not in output
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] >= 3
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


@pytest.mark.timeout(120)
def test_workers_that_start_as_the_group_is_signalled_survive() -> None:
    script = Path(__file__).with_name("group_signal_loader.py")
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["received"] == 3  # the main process got each signal
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert report["results"]["DataLoader"] == {"workers_alive": 2, "batches": batches}
    assert report["results"]["ResumableDataLoader"] == {"workers_alive": 2, "batches": batches}
    # control: workers forked without the isolation die of it
    assert report["results"]["not isolated"]["workers_alive"] < 2


def test_second_ctrl_c_stops_at_once() -> None:
    callback = PreemptionCheckpoint()
    callback._active = True
    callback._on_signal(signal.SIGINT, None)
    assert callback.received == signal.SIGINT  # the first one: save after this batch
    with pytest.raises(KeyboardInterrupt):
        callback._on_signal(signal.SIGINT, None)


@pytest.mark.parametrize("start_method", ["spawn", "fork"], ids=["spawn", "control-fork"])
def test_workers_outside_the_isolation_are_named(start_method: str) -> None:
    loader = DataLoader(list(range(4)), num_workers=1, multiprocessing_context=start_method)
    trainer = SimpleNamespace(train_dataloader=loader)
    callback = PreemptionCheckpoint()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            callback.on_train_start(trainer, None)  # type: ignore[arg-type]
        finally:
            callback.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    named = [w for w in caught if "multiprocessing_context fork" in str(w.message)]
    assert len(named) == (start_method == "spawn")
