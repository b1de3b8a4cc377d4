"""Through the CLI: 2 CPU processes with ``--trainer.strategy ddp_explicit``, and sharded training
(``configs/fsdp2.yaml``), vs ``ddp`` (the explicit strategy's other modes: tests/test_strategies.py, in process;
their options through the CLI's parser: tests/test_configs.py).

Each run is ``python -m mm_lightning fit`` on the demo config, shrunk to a few steps, on 2 processes started
together as torchrun starts them; the explicit strategy's final checkpoint must hold DDP's model and optimizer
state, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mm_lightning.checkpoints.sharded import is_sharded_checkpoint, read_entries, read_sharded_checkpoint
from mm_lightning.models import DualEncoder
from tests.conftest import tiny_demo_args
from tests.resilience.test_sharded_training import cat, relative, sharded_moments
from tests.strategies.launch import REPO, run_ranks

STRATEGY_ARGS = {
    "ddp": ["--trainer.strategy", "ddp"],
    "ddp_explicit": ["--trainer.strategy", "ddp_explicit"],
}


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    )
    return {k: v for key, sub in items for k, v in flat_tensors(sub, f"{prefix}/{key}").items()}


# Relative L2 distances. Measured: 2 processes FSDP2 vs DDP after 3 clipped steps, parameters 2.1e-8 (the gradient
# reduction's order: FSDP2 reduce-scatters where DDP all-reduces); one step fewer: see the control.
SAME_LAYOUT_TOLERANCE = 1e-5
# every step's checkpoint kept (step=1.ckpt, ...): the sharded strategy's test compares two of DDP's
STEP_CHECKPOINTS = ["--checkpoint.every_n_train_steps", "1", "--checkpoint.filename", "{step}",
                    "--checkpoint.save_top_k", "-1"]  # fmt: skip


def two_process_args(root: Path, name: str) -> list[str]:
    """The demo shrunk to 3 deterministic steps of 2 x 8 with every clipping: per tower and heads, then global."""
    return [
        *tiny_demo_args(root / name, max_steps=3),
        "--data.init_args.data_dir", str(root / "demo"),  # generated once, shared by the runs
        "--data.init_args.batch_size", "8",
        "--trainer.limit_val_batches", "0",  # last.ckpt is written when training ends
        "--trainer.accelerator", "cpu",
        "--trainer.devices", "2",
        "--trainer.deterministic", "true",
        "--model.image.clip_norm", "0.1", "--model.optim.clip_heads", "0.2", "--trainer.gradient_clip_val", "0.5",
    ]  # fmt: skip


def fit_on_two_processes(args: list[str], logs: Path) -> None:
    """``python -m mm_lightning fit <args>`` on 2 processes started together, as torchrun starts them."""
    logs.mkdir()
    for rank, result in enumerate(run_ranks(["-m", "mm_lightning", "fit", *args], logs, 2, timeout=400)):
        assert result.returncode == 0, f"rank {rank}:\n{result.output[-4000:]}"


@pytest.fixture(scope="module")
def cli_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli_parity")


@pytest.fixture(scope="module")
def checkpoints(cli_root: Path) -> dict[str, dict[str, Any]]:
    root = cli_root
    results = {}
    for name, strategy_args in STRATEGY_ARGS.items():
        run_root = root / name
        args = [*two_process_args(root, name), *strategy_args, *STEP_CHECKPOINTS]
        fit_on_two_processes(args, root / f"{name}.logs")
        results[name] = torch.load(
            run_root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
        )
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_checkpoint_matches_ddp(checkpoints: dict[str, dict[str, Any]]) -> None:
    ours, ddp = checkpoints["ddp_explicit"], checkpoints["ddp"]
    assert ours["global_step"] == ddp["global_step"] == 3
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_training_matches_ddp_and_each_process_holds_about_half(
    checkpoints: dict[str, dict[str, Any]], cli_root: Path
) -> None:
    """configs/fsdp2.yaml (FSDP2 over the 2 processes) against the DDP run above: weights and AdamW moments after 3
    clipped steps (the towers' and heads' norms summed over the shards); the checkpoint a folder written half by
    each process."""
    fsdp2 = [*two_process_args(cli_root, "fsdp2"), "--config", str(REPO / "configs" / "fsdp2.yaml")]
    fit_on_two_processes(fsdp2, cli_root / "fsdp2.logs")
    folder = cli_root / "fsdp2" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(folder)
    shards = sorted(folder.glob("__*_0.distcp"))
    sizes = [shard.stat().st_size for shard in shards]
    assert len(shards) == 2 and all(0.4 < size / sum(sizes) < 0.6 for size in sizes), sizes

    ours = read_sharded_checkpoint(folder)
    assert ours["global_step"] == 3
    network = DualEncoder.from_checkpoint(folder)  # strict: every weight in its own shape
    assert torch.equal(network.contrastive.logit_scale, ours["state_dict"]["model.contrastive.logit_scale"])
    moments = sharded_moments(folder)
    groups = read_entries(folder, "optimizer_0.param_groups.")

    def distances(ddp: dict[str, Any]) -> tuple[float, float]:
        weights = [name for name, value in ddp["state_dict"].items() if value.is_floating_point()]
        theirs = {name: value for name, value in ddp["state_dict"].items()}
        mine = {name: ours["state_dict"][name] for name in weights}
        assert all(mine[name].shape == theirs[name].shape for name in weights)  # 0-d parameters read back 0-d
        # the same optimizer order: DDP numbers the parameters, DCP names them
        saved = ddp["optimizer_states"][0]
        pairs = [
            (index, name)
            for g, group in enumerate(saved["param_groups"])
            for index, name in zip(
                group["params"], groups[f"optimizer_0.param_groups.{g}.params"], strict=True
            )
        ]
        ddp_moments = torch.cat([saved["state"][i]["exp_avg"].double().reshape(-1) for i, _ in pairs])
        return relative(cat(mine, weights), cat(theirs, weights)), relative(
            cat(moments, [n for _, n in pairs]), ddp_moments
        )

    ddp_dir = cli_root / "ddp" / "checkpoints"
    parameters, gradients = distances(torch.load(ddp_dir / "step=3.ckpt", weights_only=True))
    print(f"FSDP2 vs DDP after 3 steps: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters <= SAME_LAYOUT_TOLERANCE and gradients <= SAME_LAYOUT_TOLERANCE
    # Control: DDP one step earlier is far outside.
    parameters, gradients = distances(torch.load(ddp_dir / "step=2.ckpt", weights_only=True))
    print(f"control, one step fewer: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters > 100 * SAME_LAYOUT_TOLERANCE and gradients > 100 * SAME_LAYOUT_TOLERANCE
