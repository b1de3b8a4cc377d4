"""Length-aware batching and restorable train-loader position (mid-epoch resume)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mm_lightning.data import MultimodalDataModule
from mm_lightning.data.order import GlobalOrderSampler
from mm_lightning.extras import LengthGroupedSampler, LengthGrouping
from tests.data.helpers import TOKENIZER, coco_style


def _lengths(n: int = 2000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 60, n)


def _padding_fraction(lengths: np.ndarray, batches: np.ndarray) -> float:
    per_batch = lengths[batches]
    return float(1 - per_batch.sum() / (per_batch.max(axis=-1, keepdims=True) * batches.shape[-1]).sum())


def test_groups_similar_lengths_and_saves_padding() -> None:
    lengths = _lengths()
    grouped = LengthGroupedSampler(lengths, batch_size=16, seed=1).batches().reshape(-1, 16)
    random = np.random.default_rng(1).permutation(len(lengths))[: grouped.size].reshape(-1, 16)  # control
    assert _padding_fraction(lengths, grouped) < 0.5 * _padding_fraction(lengths, random)


def test_deterministic_per_seed_and_epoch() -> None:
    lengths = _lengths()
    a, b = LengthGroupedSampler(lengths, 8, seed=3), LengthGroupedSampler(lengths, 8, seed=3)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)  # reshuffles per epoch
    assert list(a) != list(LengthGroupedSampler(lengths, 8, seed=4))


@pytest.mark.parametrize("world", [1, 3])
def test_ranks_disjoint_and_cover_epoch(world: int) -> None:
    lengths = _lengths(1003)
    ranks = [LengthGroupedSampler(lengths, 10, num_replicas=world, rank=r) for r in range(world)]
    streams = [list(s) for s in ranks]
    assert len({len(s) for s in streams}) == 1 and len(streams[0]) % 10 == 0  # equal whole batches
    flat = [i for s in streams for i in s]
    assert len(set(flat)) == len(flat) == 1003 // (10 * world) * 10 * world  # only the < one-step tail waits
    # each rank's stream is made of whole length groups
    for stream in streams:
        batches = lengths[np.array(stream).reshape(-1, 10)]
        assert (batches.max(1) - batches.min(1)).mean() < 10


def test_length_groups_do_not_depend_on_the_number_of_ranks() -> None:
    lengths = _lengths(1000)
    one = LengthGroupedSampler(lengths, 10).batches().reshape(-1, 10)
    two = LengthGroupedSampler(lengths, 10, num_replicas=2).batches().reshape(-1, 10)
    assert np.array_equal(one, two)  # 2 ranks read the groups 1 rank reads, step by step
    other_size = LengthGroupedSampler(lengths, 20).batches().reshape(-1, 10)
    assert not np.array_equal(one, other_size)  # control: the groups follow the batch size


class _IndexRecorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["index"].tolist())
        return self.w * 0.0 + batch["image"].float().mean() * 0.0 + self.w.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(dm: MultimodalDataModule, root: Path, max_steps: int, ckpt: str | None = None) -> list[list[int]]:
    pl.seed_everything(7)
    model = _IndexRecorder()
    # Checkpoints written mid-epoch by ModelCheckpoint (after fit ends, Lightning has dropped the iterator).
    saver = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        callbacks=[saver],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model.seen


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("length_grouping", [False, True])
def test_mid_epoch_resume_continues_the_same_order(tmp_path: Path, length_grouping: bool) -> None:
    train = coco_style(tmp_path, num_images=24, captions_per_image=1)

    def dm() -> MultimodalDataModule:
        return MultimodalDataModule(
            train_file=str(train),
            tokenizer=TOKENIZER,
            batch_size=4,
            images={"size": 16},
            train_order=LengthGrouping(window_batches=2) if length_grouping else None,
        )

    full = _fit(dm(), tmp_path, max_steps=5)  # one epoch has 6 batches: resume inside it
    ckpt = tmp_path / "ckpt" / "step=2.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["MultimodalDataModule"]["train_loader"], "train loader position missing from the checkpoint"
    assert not any(
        saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    )  # held once: not also Lightning's
    resumed = _fit(dm(), tmp_path / "resumed", max_steps=5, ckpt=str(ckpt))
    assert resumed == full[2:]
    assert sorted(i for b in full for i in b) != [
        i for b in full for i in b
    ]  # control: the order is shuffled


def test_a_config_names_the_training_order_by_class_path(tmp_path: Path) -> None:
    from mm_lightning.cli import cli_main
    from tests.conftest import tiny_demo_args

    order = {"class_path": "mm_lightning.extras.LengthGrouping", "init_args": {"window_batches": 2}}
    cli = cli_main([*tiny_demo_args(tmp_path), "--data.init_args.train_order", json.dumps(order)], run=False)
    dm = cli.datamodule
    assert dm.hparams.train_order == order  # recorded as the config gave it: a checkpoint holds data
    dm.prepare_data()
    dm.setup("fit")
    sampler = dm.train_dataloader().sampler
    assert isinstance(sampler, LengthGroupedSampler) and sampler.window_batches == 2
    # control: without the option the order is the core's shuffle
    plain = cli_main(tiny_demo_args(tmp_path / "plain"), run=False).datamodule
    assert plain.hparams.train_order is None
    plain.prepare_data()
    plain.setup("fit")
    assert type(plain.train_dataloader().sampler) is GlobalOrderSampler
