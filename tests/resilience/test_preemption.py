"""Preemption with real processes: SIGTERM / SIGUSR1 save and exit 0 (SIGKILL + resume: test_resume_cli.py). The
runs that are not signalled run the same script in this process, which spares their interpreter start-ups."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from mm_lightning.extras import PreemptionCheckpoint
from tests.resilience import train_script
from tests.resilience.helpers import TinyModule, random_loader
from tests.resilience.test_checkpointing import REPO, wait_for


def start(root: Path, *args: str) -> subprocess.Popen:
    """Start the tiny training script in its own process."""
    cmd = [sys.executable, "-m", "tests.resilience.train_script", "--root", str(root), *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    """Wait for the process; return its output, failing if it did not exit with 0."""
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_saves_last_checkpoint_and_exits_cleanly(tmp_path: Path, signum: signal.Signals) -> None:
    # Step-triggered checkpoints are off (every 1000 steps): any last.ckpt comes from the signal.
    process = start(tmp_path, "--max-steps", "1000", "--every", "1000", "--sleep", "0.05")
    wait_for(tmp_path / "step3", process)
    process.send_signal(signum)
    output = finish(process, timeout=60)
    assert f"Received {signum.name}: saved" in output
    checkpoint = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)
    step = checkpoint["global_step"]
    assert 3 <= step < 1000
    assert not (tmp_path / "final.pt").exists()  # stopped, did not run to the end
    if signum == signal.SIGTERM:  # the saved run resumes and continues from where it stopped
        train_script.main(
            ["--root", str(tmp_path), "--max-steps", str(step + 3), "--every", "1000", "--ckpt-path", "last"]
        )
        assert torch.load(tmp_path / "final.pt")["global_step"] == step + 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_during_a_long_validation_stops_it_and_the_resume_is_exact(tmp_path: Path) -> None:
    """A validation of 20 batches x 0.5 s: SIGTERM is honoured after the current batch, not after the
    validation; the resumed run validates again and ends where an uninterrupted run ends."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    validation = ["--max-steps", "12", "--every", "1000", "--val-every", "5", "--val-batches", "20"]
    train_script.main(["--root", str(full), *validation])
    expected = torch.load(full / "final.pt")["params"]

    process = start(stopped, *validation, "--val-sleep", "0.5")
    wait_for(stopped / "validating5", process)  # the first validation batch at step 5 is done
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output = finish(process, timeout=60)
    waited = time.monotonic() - signalled
    print(f"SIGTERM during validation: exited {waited:.1f} s later (the validation takes 10 s)")
    assert waited < 5, output  # not held until the validation ends
    assert "Received SIGTERM: saved" in output
    assert torch.load(stopped / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == 5

    train_script.main(["--root", str(stopped), *validation, "--ckpt-path", "last"])
    resumed = torch.load(stopped / "final.pt")
    assert resumed["global_step"] == 12
    torch.testing.assert_close(resumed["params"], expected, rtol=0, atol=1e-6)


def test_signal_handlers_are_restored_after_fit() -> None:
    watched = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in watched}
    seen_during_fit = {}

    class Probe(PreemptionCheckpoint):
        def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
            seen_during_fit.update({s: signal.getsignal(s) for s in watched})
            super().on_train_batch_end(trainer, *args)

    trainer = Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(TinyModule(), random_loader(16))
    assert all(
        getattr(h, "__func__", None) is PreemptionCheckpoint._on_signal for h in seen_during_fit.values()
    )
    assert {s: signal.getsignal(s) for s in watched} == before
