"""Sharding across 2 gloo processes: disjoint ranks, full epoch coverage, per-epoch reshuffle from the seed;
bad records met on both ranks counted once."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from mm_lightning import gloo_exit_abort
from mm_lightning.callbacks.bad_records import BadRecordLogger
from mm_lightning.data import MultimodalDataModule
from mm_lightning.extras.length_grouping import LengthGroupedSampler, LengthGrouping, caption_lengths
from tests.data.helpers import TOKENIZER, coco_style, one_bad_image_with_five_captions

SEED = 123


class _ShardRecorder(pl.LightningModule):
    """Writes the item indices each rank sees per epoch to ``out/rank{r}.json``."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[int, list[int]] = {}

    def setup(self, stage: str) -> None:
        gloo_exit_abort.install()  # as the CLI does: else a gloo rank can abort at interpreter exit

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).extend(batch["index"].tolist())
        return self.w * 0.0

    def on_train_end(self) -> None:
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _two_ranks(**kwargs: object) -> pl.Trainer:
    """2 gloo processes, 2 epochs, seeded; nothing written but what the test's own callbacks write."""
    pl.seed_everything(SEED)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("length_grouping", [False, True])
def test_two_ranks_disjoint_cover_and_reshuffle(tmp_path: Path, length_grouping: bool) -> None:
    train = coco_style(tmp_path, num_images=24, captions_per_image=1, size=(20, 16))
    dm = MultimodalDataModule(
        train_file=str(train),
        tokenizer=TOKENIZER,
        batch_size=4,
        images={"size": 16},
        train_order=LengthGrouping(window_batches=2) if length_grouping else None,
    )
    _two_ranks().fit(_ShardRecorder(str(tmp_path)), datamodule=dm)
    seen = [
        {int(k): v for k, v in json.loads((tmp_path / f"rank{r}.json").read_text()).items()} for r in (0, 1)
    ]

    for epoch in (0, 1):
        ranks = [seen[0][epoch], seen[1][epoch]]
        assert not set(ranks[0]) & set(ranks[1])  # disjoint
        assert sorted(ranks[0] + ranks[1]) == list(range(24))  # 24 = 2 ranks x 3 batches x 4: whole epoch
    assert seen[0][0] != seen[0][1]  # reshuffled per epoch

    # ...and the order is exactly the seeded one (so every rank agrees and a resume can replay it)
    for epoch in (0, 1):
        for rank in (0, 1):
            if length_grouping:
                dm.setup("fit")  # the spawned ranks had their own copy; index here for the lengths
                lengths = caption_lengths(dm.datasets["train"])
                sampler = LengthGroupedSampler(
                    lengths, 4, num_replicas=2, rank=rank, seed=SEED, window_batches=2
                )
                sampler.set_epoch(epoch)
                expected = list(sampler)
            else:
                # global step b reads the epoch's order [8b, 8b + 8), rank r the r-th 4 of them
                order = np.random.default_rng([SEED, epoch]).permutation(24).reshape(-1, 2, 4)
                expected = order[:, rank].reshape(-1).tolist()
            assert seen[rank][epoch] == expected


class _SkipCounts(BadRecordLogger):
    """Writes, per rank, the records met in each training epoch (before joining) and the joined count."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out, self.met = out, []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.met.append(len(self.local.pending.get("train", {})))
        super().on_train_epoch_end(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log = self._summarize(trainer)
        result = {"met": self.met, "count": log.count, "by_kind": log.by_kind()}
        Path(self.out, f"skips{trainer.global_rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_count_a_bad_image_with_five_captions_five_times_an_epoch(tmp_path: Path) -> None:
    train = one_bad_image_with_five_captions(tmp_path)
    dm = MultimodalDataModule(
        train_file=str(train),
        tokenizer=TOKENIZER,
        batch_size=2,
        on_bad_record="skip",
        images={"size": 16},
        loader={"caption_sampling": "all"},
    )
    _two_ranks(callbacks=[_SkipCounts(str(tmp_path))]).fit(_ShardRecorder(str(tmp_path)), datamodule=dm)
    ranks = [json.loads((tmp_path / f"skips{r}.json").read_text()) for r in (0, 1)]
    # control: both ranks met the image's records in an epoch, so summing what each met counts them twice
    assert any(a + b > 5 for a, b in zip(ranks[0]["met"], ranks[1]["met"], strict=True))
    for rank in ranks:
        assert rank["count"] == 10 and rank["by_kind"] == {"undecodable_image": 10}  # 5 records x 2 epochs
