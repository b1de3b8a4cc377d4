"""MultimodalModule on 2 CPU processes under the explicit all-reduce strategy.

One spawned fit step checks that (a) the reduced gradients equal the single-process gradients on the
concatenated batch (global negatives with a gradient-carrying gather stay exact under ``ddp_explicit``), and
(b) validation retrieval over both ranks, with the sampler's padding duplicate removed, equals the
single-process metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, Subset

import mm_lightning.config_parser  # noqa: F401  (registers ddp_explicit_spawn)
from mm_lightning.models import MultimodalModule
from tests.models.helpers import EXACT_MODEL as EXACT_MODEL_BASE
from tests.models.helpers import PairDataset, module_kwargs, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PER_RANK = 4
# no random ITM negatives either
EXACT_MODEL = tiny_config(EXACT_MODEL_BASE, objective={"itm_weight": 0.0})


class GradProbe(MultimodalModule):
    """Saves the gradients seen by gradient clipping (after the strategy's reduction) on the first step."""

    def __init__(self, out_dir: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        if self.global_step == 0:
            grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}
            torch.save(grads, Path(self.out_dir) / f"grads_rank{self.global_rank}.pt")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def _loaders() -> tuple[DataLoader, DataLoader]:
    train = PairDataset(size=2 * PER_RANK, classes=2 * PER_RANK)
    # odd: the sampler pads one duplicate; one image per id (ids shared by different images would make "the"
    # image of an id depend on which of its rows comes first, hence on the batch layout)
    val = Subset(PairDataset(size=13, classes=13, seed=1), range(13))
    return DataLoader(train, batch_size=PER_RANK), DataLoader(val, batch_size=4)


def _single_process_grads(state: dict) -> dict[str, torch.Tensor]:
    model = MultimodalModule(**module_kwargs(EXACT_MODEL))
    model.load_state_dict(state)
    train = PairDataset(size=2 * PER_RANK, classes=2 * PER_RANK)
    batch = next(iter(DataLoader(train, batch_size=2 * PER_RANK)))
    model.training_step(batch, 0).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_ddp_explicit_gradients_and_global_val_metrics_match_single_process(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GradProbe(out_dir=str(tmp_path), **module_kwargs(EXACT_MODEL))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = _loaders()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_explicit_spawn",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, train, val)
    distributed_metrics = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("val/")}

    want = _single_process_grads(initial)
    for rank in range(2):
        got = torch.load(tmp_path / f"grads_rank{rank}.pt")
        assert set(got) == set(want)
        worst = max((got[n] - want[n]).abs().max().item() for n in want)
        scale = max(want[n].abs().max().item() for n in want)
        print(f"rank {rank}: max abs gradient deviation {worst:.2e} (largest gradient entry {scale:.2e})")
        # fp32 sums in a different order through a whole network: agreement to float rounding
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)
    # control: the reference is not trivially matched (a rank's own half-batch gives other gradients)
    half = MultimodalModule(**module_kwargs(EXACT_MODEL))
    half.load_state_dict(initial)
    half.training_step(next(iter(train)), 0).backward()
    assert (
        max((p.grad - want[n]).abs().max().item() for n, p in half.named_parameters() if p.grad is not None)
        > 1e-2
    )

    # the spawn launcher returned the trained weights: validate them in one process
    single = Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    reference = single.validate(model, val, verbose=False)[0]
    assert "val/loss" in distributed_metrics and "val/r1_t2i" in distributed_metrics
    for key, value in distributed_metrics.items():
        assert value == pytest.approx(reference[key], abs=1e-5 if key == "val/loss" else 1e-6), key
    # val/loss is scored on chunks of 4 records (a rank's batch) in file order, the padding duplicate left out:
    # chunks of another size give another value
    chunks_of_8 = single.validate(model, DataLoader(val.dataset, batch_size=2 * 4), verbose=False)[0]
    assert abs(chunks_of_8["val/loss"] - distributed_metrics["val/loss"]) > 1e-4
