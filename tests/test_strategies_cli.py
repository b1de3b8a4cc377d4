"""Through the CLI: 2 CPU processes with ``--trainer.strategy ddp_explicit`` (both modes) vs ``ddp``.

Each run is ``python -m mm_lightning fit`` on the demo config, shrunk to a few steps (Lightning's popen launcher
starts rank 1); the final checkpoints must hold the same model and optimizer state, bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.conftest import tiny_demo_args
from tests.strategies.launch import REPO

STRATEGY_ARGS = {
    "ddp": ["--trainer.strategy", "ddp"],
    "ddp_explicit": ["--trainer.strategy", "ddp_explicit"],
    # A string strategy name takes no nested options; the class does (as in configs/ddp_explicit.yaml).
    "per_parameter": [
        "--trainer.strategy",
        "mm_lightning.extras.ExplicitAllReduceDDPStrategy",
        "--trainer.strategy.mode",
        "per_parameter",
    ],
}


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    )
    return {k: v for key, sub in items for k, v in flat_tensors(sub, f"{prefix}/{key}").items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("cli_parity")
    results = {}
    for name, strategy_args in STRATEGY_ARGS.items():
        run_root = root / name
        args = [
            *tiny_demo_args(run_root, max_steps=5),
            "--data.init_args.data_dir", str(root / "demo"),  # generated once, shared by the runs
            "--data.init_args.batch_size", "8",
            "--trainer.limit_val_batches", "0",  # last.ckpt is written when training ends
            "--trainer.accelerator", "cpu",
            "--trainer.devices", "2",
            *strategy_args,
        ]  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "mm_lightning", "fit", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, f"{name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        results[name] = torch.load(
            run_root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
        )
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["ddp_explicit", "per_parameter"])
def test_cli_checkpoint_matches_ddp(checkpoints: dict[str, dict[str, Any]], variant: str) -> None:
    ours, ddp = checkpoints[variant], checkpoints["ddp"]
    assert ours["global_step"] == ddp["global_step"] == 5
    assert ours["state_dict"].keys() == ddp["state_dict"].keys()
    differing = [k for k, v in ddp["state_dict"].items() if not torch.equal(v, ours["state_dict"][k])]
    assert differing == []
    ours_opt, ddp_opt = flat_tensors(ours["optimizer_states"]), flat_tensors(ddp["optimizer_states"])
    assert len(ddp_opt) > 10 and ours_opt.keys() == ddp_opt.keys()
    assert [k for k, v in ddp_opt.items() if not torch.equal(v, ours_opt[k])] == []


@pytest.mark.slow
def test_cli_runs_trained(checkpoints: dict[str, dict[str, Any]]) -> None:
    # Control: the runs really moved the weights (equal checkpoints are not just two untouched initialisations).
    state = checkpoints["ddp_explicit"]["state_dict"]
    moments = flat_tensors(checkpoints["ddp_explicit"]["optimizer_states"])
    assert any(v.abs().sum() > 0 for k, v in moments.items() if k.endswith("exp_avg"))
    assert len(state) > 20
