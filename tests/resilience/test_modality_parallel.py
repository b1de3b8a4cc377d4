"""Modality parallelism (``configs/modality_parallel.yaml``: the image tower on rank 0, the text tower on rank 1,
gloo) through the real CLI, against plain DDP on the same 2 x 4 global batch: the weights and AdamW moments after
each step equal DDP's; each process saved only its own tower; a run killed after step 3's checkpoint resumes to
DDP's final weights, reading each sample of the epoch once."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mm_lightning.checkpoints.sharded import (
    is_sharded_checkpoint,
    read_entries,
    read_metadata,
    read_sharded_checkpoint,
)
from mm_lightning.models.optim import param_groups
from tests.conftest import REPO
from tests.resilience.test_elastic_resume import IMAGES, KILLED_AT, data, fit_args, launch, resumed_copy
from tests.test_process_exit import exit_problems, run_or_report_hang

__all__ = ["data"]  # the elastic tests' data: 48 training images, 6 steps of 2 x 4
OVERLAY = ["--config", str(REPO / "configs" / "modality_parallel.yaml")]
# Relative L2 distances to DDP. Measured after 6 steps: parameters 1.8e-5 (the towers sum the gradients of all
# rows in one backward where DDP sums per-rank ones: reduction order, which AdamW's normalized steps carry).
PARAMETER_TOLERANCE, GRADIENT_TOLERANCE = 1e-4, 1e-5


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


def distances(folder: Path, ddp: dict[str, Any]) -> tuple[float, float]:
    """Parameters and AdamW exp_avg of a modality-parallel checkpoint against a DDP one."""
    ours = read_sharded_checkpoint(folder)
    assert ours["global_step"] == ddp["global_step"]
    names = [name for name, value in ddp["state_dict"].items() if value.is_floating_point()]
    weights = relative(
        torch.cat([ours["state_dict"][n].reshape(-1) for n in names]),
        torch.cat([ddp["state_dict"][n].reshape(-1) for n in names]),
    )
    prefix, suffix = "optimizer_0.state.", ".exp_avg"
    moments = {
        key[len(prefix) : -len(suffix)]: value
        for key, value in read_entries(folder, prefix).items()
        if key.endswith(suffix)
    }
    saved = ddp["optimizer_states"][0]
    gradients = relative(
        torch.cat([moments[name].reshape(-1) for name in ddp_optimizer_order(ddp, moments)]),
        torch.cat(
            [
                saved["state"][index]["exp_avg"].reshape(-1)
                for group in saved["param_groups"]
                for index in group["params"]
            ]
        ),
    )
    return weights, gradients


def ddp_optimizer_order(ddp: dict[str, Any], trained: Iterable[str]) -> list[str]:
    """The names of the parameters DDP's optimizer numbers 0, 1, ...: its groups, rebuilt from the module's
    parameter order as the module builds them (each tower, then the heads)."""
    state = ddp["state_dict"]
    params = {name: nn.Parameter(state[name]) for name in state if name in set(trained)}
    tower = lambda kind: [(n, p) for n, p in params.items() if n.startswith(f"model.{kind}_encoder.")]  # noqa: E731
    groups = param_groups(
        {
            "image_encoder": (tower("image"), 0.0),
            "text_encoder": (tower("text"), 0.0),
            "heads": (list(params.items()), 0.0),
        },
        0.0,
    )
    names = {id(p): n for n, p in params.items()}
    assert [g["name"] for g in groups] == [g["name"] for g in ddp["optimizer_states"][0]["param_groups"]]
    return [names[id(p)] for group in groups for p in group["params"]]


def rank_samples(run: Path, rank: int, steps: range) -> list[int]:
    """The sample indices one process trained on in ``steps``."""
    rows = [json.loads(line) for line in (run / "samples" / f"rank{rank}.jsonl").read_text().splitlines()]
    return [index for row in rows if row["step"] in steps for index in row["index"]]


def mp_args(data: Path, run: Path, kill_at: int | None = None) -> list[str]:
    return [*fit_args(data, run, 2, 4, kill_at=kill_at), *OVERLAY]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_modality_parallel_equals_ddp_and_resumes_exactly(data: Path, tmp_path: Path) -> None:
    ddp = tmp_path / "ddp"
    launch([*fit_args(data, ddp, 2, 4), "--checkpoint.filename", "{step}", "--checkpoint.save_top_k", "-1"])

    killed = tmp_path / "killed"
    launch(mp_args(data, killed, kill_at=KILLED_AT), killed=True)
    folder = killed / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(folder)
    # each process wrote its own tower and its moments; the shared heads once
    owners = {index.fqn: info.relative_path for index, info in read_metadata(folder).storage_data.items()}
    for fqn, shard in owners.items():
        if ".image_encoder." in fqn or ".image_proj." in fqn:
            assert shard == "__0_0.distcp", fqn
        if ".text_encoder." in fqn or ".text_proj." in fqn:
            assert shard == "__1_0.distcp", fqn
    parameters, gradients = distances(folder, torch.load(ddp / "checkpoints" / f"step={KILLED_AT}.ckpt"))
    print(f"after {KILLED_AT} steps: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE

    control = resumed_copy(killed, tmp_path / "control")
    result = run_or_report_hang(
        [sys.executable, "-m", "mm_lightning", *mp_args(data, killed), "--ckpt_path", "last"], timeout=300
    )
    assert exit_problems(result.returncode, result.stdout) == [], result.stdout[-5000:]
    assert "rank 0: image tower" in result.stdout and "rank 1: text tower" in result.stdout
    # each group read each sample of the epoch once, both the same ones in the same steps
    epoch = range(IMAGES // 8)
    assert Counter(rank_samples(killed, 0, epoch)) == Counter(range(IMAGES))
    assert rank_samples(killed, 1, epoch) == rank_samples(killed, 0, epoch)
    final = torch.load(ddp / "checkpoints" / f"step={IMAGES // 8}.ckpt")
    parameters, gradients = distances(folder, final)
    print(
        f"after {IMAGES // 8} steps, killed and resumed: parameters {parameters:.1e}, gradient means {gradients:.1e}"
    )
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE

    # Control: the same resume with one sample of the rest of the epoch changed ends outside both tolerances.
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "images").symlink_to(data / "images")
    shutil.copy(data / "val.jsonl", changed / "val.jsonl")
    lines = (data / "train.jsonl").read_text().splitlines()
    later = rank_samples(killed, 0, range(KILLED_AT, IMAGES // 8))[0]
    record = json.loads(lines[later])
    lines[later] = json.dumps({**record, "text": ["a tiny green star on a white background"]})
    (changed / "train.jsonl").write_text("\n".join(lines) + "\n")
    launch([*mp_args(changed, control), "--ckpt_path", "last"])
    parameters, gradients = distances(control / "checkpoints" / "last.ckpt", final)
    print(f"control, one sample changed: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters > PARAMETER_TOLERANCE and gradients > GRADIENT_TOLERANCE
