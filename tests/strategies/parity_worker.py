"""One rank of the parity run: trains TinyNet for every case under stock DDP and ddp_explicit, saves the results.

Started by ``tests/test_strategies.py`` as two processes with torchrun-style environment variables
(``tests/strategies/launch.py``); all fits share one gloo process group. Usage:
``python tests/strategies/parity_worker.py OUT_DIR``. Writes ``OUT_DIR/<case>/<variant>_rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.optim import Optimizer
from typing_extensions import override

from mm_lightning.extras import ExplicitAllReduceDDPStrategy
from tests.strategies.tiny import TinyNet, tiny_loader

CASES: dict[str, dict[str, Any]] = {
    # Validation between steps exercises DDP's buffer-sync rule around eval forwards.
    "fp32": {"trainer": {"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 2}, "model": {}},
    "accumulate_clip": {
        "trainer": {"max_steps": 5, "accumulate_grad_batches": 2, "gradient_clip_val": 1.0},
        "model": {"lr": 0.05, "loss_scale": 4.0},
    },
    "fp16_scaler": {"trainer": {"max_steps": 6}, "model": {"overflow_rank1_steps": (2, 4)}, "scaler": True},
    "one_rank_param": {"trainer": {"max_steps": 6}, "model": {"rank0_only_head": True}, "find_unused": True},
    # The model engineer's global-negative contrastive loss (all_gather with gradient) under each strategy.
    "contrastive_gather": {"trainer": {"max_steps": 5}, "model": {"contrastive": True}},
    "manual_two_optimizers": {"trainer": {"max_steps": 4}, "model": {"manual": True}},
}
VARIANTS = ("ddp", "per_parameter", "bucketed", "bucketed_overlap")
CONTROL_CASE = "fp32"


class NoReduceStrategy(ExplicitAllReduceDDPStrategy):
    """The control: identical except that gradients are never reduced, so ranks train on their own data."""

    @override
    def reduce_gradients(self, optimizer: Optimizer | None = None) -> None:
        self._backward_since_reduce = False


class RecordScale(pl.Callback):
    """Records the GradScaler scale after each step (a drop means the step was skipped for inf/NaN)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


class RecordOverlap(pl.Callback):
    """Records how many buckets each step launched during backward (bucketed_overlap only)."""

    def __init__(self) -> None:
        self.overlapped: list[int] = []

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self.overlapped += [r.overlapped_buckets for r in trainer.strategy._reducers.values()]


def make_strategy(variant: str, find_unused: bool) -> Strategy:
    if variant == "ddp":
        return DDPStrategy(find_unused_parameters=find_unused)
    if variant == "no_reduce":
        return NoReduceStrategy()
    # A tiny bucket cap forces several buckets, so bucket boundaries are exercised too.
    if variant == "bucketed_overlap":
        return ExplicitAllReduceDDPStrategy(mode="bucketed", bucket_cap_mb=0.002, overlap_backward=True)
    return ExplicitAllReduceDDPStrategy(mode=variant, bucket_cap_mb=0.002)


def run_case(name: str, variant: str, out_dir: Path) -> None:
    case = CASES[name]
    # Different initial weights per rank: every strategy must start from rank 0's.
    torch.manual_seed(100 + int(os.environ["RANK"]))
    model = TinyNet(**case["model"])
    scale, overlap = RecordScale(), RecordOverlap()
    callbacks: list[pl.Callback] = [overlap] if variant == "bucketed_overlap" else []
    plugins = []
    if case.get("scaler"):
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        callbacks.append(scale)
    trainer_args = {"num_sanity_val_steps": 1, "limit_val_batches": 0, **case["trainer"]}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=make_strategy(variant, case.get("find_unused", False)),
        plugins=plugins,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(model, train_dataloaders=tiny_loader(), val_dataloaders=tiny_loader(n=16, seed=1))
    result = {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads_none": sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None),
        "pre_clip_grad_norms": model.pre_clip_grad_norms,
        "scales": scale.scales,
        "overlapped_buckets": overlap.overlapped,
        "global_step": trainer.global_step,
    }
    target = out_dir / name
    target.mkdir(parents=True, exist_ok=True)
    torch.save(result, target / f"{variant}_rank{trainer.global_rank}.pt")


def forgotten_manual_reduce(out_dir: Path) -> None:
    """Manual optimization without ``reduce_gradients``: must fail loudly on every rank, not diverge silently."""
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ExplicitAllReduceDDPStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(TinyNet(manual=True, manual_reduce=False), train_dataloaders=tiny_loader())
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    (out_dir / f"forgotten_manual_reduce_rank{trainer.global_rank}.txt").write_text(message)


def main(out_dir: Path) -> None:
    for name in CASES:
        for variant in VARIANTS:
            run_case(name, variant, out_dir)
    run_case(CONTROL_CASE, "no_reduce", out_dir)
    forgotten_manual_reduce(out_dir)
    print("PARITY WORKER DONE", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
