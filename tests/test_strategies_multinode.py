"""Two simulated nodes on 127.0.0.1: two ``torchrun --nnodes 2 --node_rank 0/1`` launches of the CLI with ddp_explicit.

Lightning reads the torchrun environment (TorchElasticEnvironment), so this is the README's multi-node command
with both "nodes" on one machine and gloo instead of NCCL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_demo_args
from tests.strategies.launch import REPO, free_port, kill_all


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_finish_with_identical_parameters(tmp_path: Path) -> None:
    port = free_port()
    states = tmp_path / "states"
    save_state = {
        "class_path": "tests.strategies.save_state.SaveRankState",
        "init_args": {"out_dir": str(states)},
    }
    procs = []
    for node_rank in (0, 1):
        cli_args = [
            *tiny_demo_args(tmp_path / f"node{node_rank}", max_steps=5),
            # Each node prepares its own copy of the (deterministic) demo data, as nodes without shared storage do.
            "--data.init_args.batch_size", "8",
            "--trainer.val_check_interval", "5",
            "--trainer.limit_val_batches", "1",
            "--trainer.accelerator", "cpu",
            "--trainer.devices", "1",
            "--trainer.num_nodes", "2",
            "--trainer.strategy", "ddp_explicit",
            f"--trainer.callbacks+={json.dumps(save_state)}",
        ]  # fmt: skip
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
        ]  # fmt: skip
        log = (tmp_path / f"node{node_rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [*torchrun, "-m", "mm_lightning", "fit", *cli_args], cwd=REPO, stdout=log, stderr=log
            )
        )
    deadline = time.monotonic() + 500
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        kill_all(procs)
    for node_rank, proc in enumerate(procs):
        assert proc.returncode == 0, (tmp_path / f"node{node_rank}.log").read_text()[-4000:]

    rank0, rank1 = (torch.load(states / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rank0["world_size"] == rank1["world_size"] == 2 and rank0["num_nodes"] == 2
    assert (rank0["node_rank"], rank1["node_rank"]) == (0, 1)
    assert rank0["global_step"] == rank1["global_step"] == 5
    # Parameters agree bit for bit; BatchNorm running stats may differ (local last forward, as under DDP).
    params = [
        k
        for k in rank0["state_dict"]
        if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))
    ]
    assert len(params) > 20
    assert [k for k in params if not torch.equal(rank0["state_dict"][k], rank1["state_dict"][k])] == []
