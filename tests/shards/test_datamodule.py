"""ShardDataModule in Python: weighted mixes of shards and JSONL, validation from JSONL.

(configs/shards.yaml through the CLI: tests/shards/test_resume.py and test_remote.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_lightning.extras import LengthGrouping, ShardDataModule, Source
from mm_lightning.extras.shards.datamodule import UnorderableMix
from tests.data.helpers import TOKENIZER, coco_style
from tests.shards.helpers import uneven_shards


def test_mix_of_shards_and_jsonl_with_weights(tmp_path: Path) -> None:
    pattern = uneven_shards(tmp_path / "shards", sizes=(5, 3))
    jsonl = coco_style(tmp_path / "coco", num_images=4, captions_per_image=2)
    dm = ShardDataModule(
        sources=[Source(shards=pattern, weight=2.0), Source(file=str(jsonl), weight=1.0)],
        val_file=str(jsonl),
        tokenizer=TOKENIZER,
        batch_size=4,
        images={"size": 32},
    )
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == (2 * 8 + 4) // 4
    indices = [i for b in batches for i in b["index"].tolist()]
    assert sum(i < 8 for i in indices) == 16 and sum(i >= 8 for i in indices) == 4
    ids = {i: int(b["image_id"][k]) for b in batches for k, i in enumerate(b["index"].tolist())}
    assert all(ids[i] >= 8 for i in indices if i >= 8)  # JSONL image ids shifted past the shards'
    val = next(iter(dm.val_dataloader()))
    assert val["image"].shape == (4, 3, 32, 32)  # validation from JSONL while training from shards
    dm.train_order = LengthGrouping()  # orders a JSONL split by caption length: a mix is refused in one line
    with pytest.raises(UnorderableMix, match="LengthGrouping orders a JSONL training split"):
        dm.train_dataloader()


def test_shard_batches_in_slots_equal_the_ones_without(tmp_path: Path) -> None:
    pattern = uneven_shards(tmp_path / "shards", sizes=(6, 6))
    runs = {}
    for persistent in (True, False):
        dm = ShardDataModule(
            sources=[Source(shards=pattern)],
            tokenizer=TOKENIZER,
            batch_size=3,
            num_workers=2,
            images={"size": 32},
            loader={"persistent_workers": persistent, "batch_slots": True, "normalize_on": "device"},
        )
        dm.setup("fit")
        loader = dm.train_dataloader()
        batches = list(loader)
        slots = loader.collate_fn.slots
        assert (slots is not None and all(slots.owns(b["image"]) for b in batches)) == persistent
        runs[persistent] = {tuple(b["index"].tolist()): b["image"] for b in batches}
    assert runs[True].keys() == runs[False].keys() and len(runs[True]) == 4
    assert all(torch.equal(runs[True][k], runs[False][k]) for k in runs[True])
