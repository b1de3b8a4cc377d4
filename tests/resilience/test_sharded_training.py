"""Sharded training (``configs/fsdp2.yaml``: FSDP2 over CPU processes, gloo) through the real CLI: a run killed
after a checkpoint resumes on another number of processes (2 -> 1, and 1 -> 2 from an uninterrupted run's
checkpoint at the same step; the global batch kept), reads each sample of the epoch once and ends on the
uninterrupted weights. Its equality with DDP in the same layout is tested
beside the other strategies' (tests/test_strategies_cli.py)."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mm_lightning.checkpoints.sharded import is_sharded_checkpoint, read_entries, read_sharded_checkpoint
from mm_lightning.cli import main
from mm_lightning.data.resume import ResumableDataLoader
from tests.conftest import REPO
from tests.resilience.test_elastic_resume import (
    IMAGES,
    KILLED_AT,
    data,
    fit_args,
    launch,
    relative,
    resumed_copy,
    seen_in,
)

__all__ = ["data"]  # the elastic tests' data: 48 training images, 6 steps of 8 per epoch
OVERLAY = ["--config", str(REPO / "configs" / "fsdp2.yaml")]
# A resume on another number of processes, against an uninterrupted run (as tests/resilience/test_elastic_resume.py).
PARAMETER_TOLERANCE, GRADIENT_TOLERANCE = 1e-4, 1e-5
unpatched = ResumableDataLoader.load_position


def sharded_moments(folder: Path) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg of a sharded checkpoint by parameter name."""
    prefix, suffix = "optimizer_0.state.", ".exp_avg"
    entries = read_entries(folder, prefix)
    return {key[len(prefix) : -len(suffix)]: value for key, value in entries.items() if key.endswith(suffix)}


def cat(state: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([state[name].double().reshape(-1) for name in names])


def final(run: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    folder = run / "checkpoints" / "last.ckpt"
    checkpoint = read_sharded_checkpoint(folder)
    return checkpoint["state_dict"], sharded_moments(folder), checkpoint["global_step"]


def resume_distances(run: Path, reference: Path, steps: int = IMAGES // 8) -> tuple[float, float]:
    weights, moments, step = final(run)
    expected_weights, expected_moments, expected_step = final(reference)
    assert (step, expected_step) == (steps, IMAGES // 8)
    names = sorted(name for name, value in expected_weights.items() if value.is_floating_point())
    return (
        relative(cat(weights, names), cat(expected_weights, names)),
        relative(cat(moments, sorted(expected_moments)), cat(expected_moments, sorted(expected_moments))),
    )


def fit_in_process(args: list[str]) -> None:
    """One process, in this one: the process group it starts, and the address it wrote for it, go with it."""
    environment = dict(os.environ)
    try:
        assert main(args) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)  # a later launch picks its own port


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_runs_resume_on_another_number_of_processes(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    epoch = Counter(range(IMAGES))
    reference = tmp_path / "reference"
    at_killed = [  # its checkpoint at step 3 also, as a run killed there leaves it
        "--best_checkpoint.monitor=null",
        f"--best_checkpoint.every_n_train_steps={KILLED_AT}",
        "--best_checkpoint.save_top_k=-1",
        "--best_checkpoint.filename=step={step}",
    ]
    fit_in_process([*fit_args(data, reference, 1, 8), *OVERLAY, *at_killed])

    # 2 x 4, killed after step 3's checkpoint, resumed on 1 x 8
    killed = tmp_path / "killed_on_2"
    launch([*fit_args(data, killed, 2, 4, kill_at=KILLED_AT), *OVERLAY], killed=True)
    assert is_sharded_checkpoint(killed / "checkpoints" / "last.ckpt")
    control = resumed_copy(killed, tmp_path / "control")
    fit_in_process([*fit_args(data, killed, 1, 8), *OVERLAY, "--ckpt_path", "last"])
    assert seen_in(killed, killed) == epoch
    parameters, gradients = resume_distances(killed, reference)
    print(f"2 -> 1: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE

    # 1 x 8, its step-3 checkpoint resumed on 2 x 4
    on_two = tmp_path / "on_two"
    shutil.copytree(
        reference / "checkpoints" / f"step={KILLED_AT}.ckpt", on_two / "checkpoints" / "last.ckpt"
    )
    launch([*fit_args(data, on_two, 2, 4), *OVERLAY, "--ckpt_path", "last"])
    assert seen_in(reference, on_two) == epoch
    parameters, gradients = resume_distances(on_two, reference)
    print(f"1 -> 2: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE

    # Control: the 2 -> 1 resume with one batch left out ends outside both tolerances.
    def skip_a_batch(self: ResumableDataLoader, state: dict[str, Any]) -> None:
        saved = dict(state[ResumableDataLoader.KEY])
        saved["consumed"] += saved["world_size"] * saved["batch_size"]
        unpatched(self, {ResumableDataLoader.KEY: saved})

    monkeypatch.setattr(ResumableDataLoader, "load_position", skip_a_batch)
    fit_in_process([*fit_args(data, control, 1, 8), *OVERLAY, "--ckpt_path", "last"])
    parameters, gradients = resume_distances(control, reference, steps=IMAGES // 8 - 1)
    assert parameters > 10 * PARAMETER_TOLERANCE and gradients > 1000 * GRADIENT_TOLERANCE
