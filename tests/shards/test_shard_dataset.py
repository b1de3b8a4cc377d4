"""ShardDataset: same samples as the JSONL path, multi-caption, and the bad-record policy on shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mm_lightning.data.images import decode_image_file
from mm_lightning.data.order import Visit
from mm_lightning.data.records import RecordError
from mm_lightning.extras.shards.files import ShardError, list_shards
from tests.shards.helpers import CAPTIONS_PER_SAMPLE, caption, jpeg_bytes, uneven_shards, write_shard
from tests.shards.helpers import shard_dataset as dataset


def test_listing_counts_from_stats_and_from_the_tar(tmp_path: Path) -> None:
    pattern = uneven_shards(tmp_path / "a")
    assert [s.nsamples for s in list_shards(pattern)] == [7, 3, 11, 5]
    bare = uneven_shards(tmp_path / "b", stats=False)  # no _stats.json: counted by indexing the tar
    assert [s.nsamples for s in list_shards(bare)] == [7, 3, 11, 5]


def test_samples_decode_like_files_and_carry_every_caption(tmp_path: Path) -> None:
    ds = dataset(uneven_shards(tmp_path), caption_sampling="all")
    assert len(ds) == 26 * CAPTIONS_PER_SAMPLE and ds.item_counts() == [14, 6, 22, 10]
    item = ds[2 * 12 + 1]  # sample 12 (third shard), second caption
    assert item["caption"] == caption(12, 1) and item["image_id"] == 12
    reference = tmp_path / "ref.jpg"
    reference.write_bytes(jpeg_bytes(12))
    assert torch.equal(item["image"], decode_image_file(str(reference)))
    random = dataset(uneven_shards(tmp_path))
    drawn = {random.__getitems__([Visit(12, epoch, 5), 13])[0]["caption"] for epoch in range(20)}
    assert drawn == {caption(12, 0), caption(12, 1)}  # draws seeded per visit cover both captions
    first, second = (random.__getitems__([Visit(12, 4, 5), n])[0]["caption"] for n in (13, 20))
    assert first == second  # the same visit draws the same caption whatever the batch holds


def test_txt_is_the_caption_when_json_has_none(tmp_path: Path) -> None:
    ds = dataset(uneven_shards(tmp_path), text_key="caption")  # the .json has "text", not "caption"
    assert ds[4]["caption"] == caption(4, 0)


@pytest.fixture
def corrupt(tmp_path: Path) -> str:
    write_shard(tmp_path / "00000.tar", 0, 4, broken={2: b"<html>404 not found</html>"})
    write_shard(tmp_path / "00001.tar", 4, 4)
    return str(tmp_path / "{00000..00001}.tar")


def test_corrupt_member_raises_naming_shard_and_key(corrupt: str) -> None:
    where = r"00000\.tar \[sample 000000002\] \(image '000000002\.jpg'\): .*not a decodable image"
    with pytest.raises(RecordError, match=where):
        dataset(corrupt)[2]


def test_corrupt_member_is_a_counted_skip_replaced_from_the_same_shard(corrupt: str) -> None:
    batch = dataset(corrupt, on_bad_record="skip").__getitems__(list(range(8)))
    assert [len(b["skipped"]) for b in batch] == [0, 0, 1, 0, 0, 0, 0, 0]
    (error,) = batch[2]["skipped"]
    assert (
        error.sample == "000000002" and error.file.endswith("00000.tar") and error.kind == "undecodable_image"
    )
    assert batch[2]["index"] in (0, 1, 3)  # a valid sample of the same (open) shard stands in


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_shard_skips_its_missing_tail_and_names_it(tmp_path: Path) -> None:
    pattern = uneven_shards(tmp_path, sizes=(10, 10))
    truncate(tmp_path / "00000.tar", 0.5)  # stats still say 10 samples
    ds = dataset(pattern, on_bad_record="skip")
    items = ds.__getitems__(list(range(20)))
    skipped = sum(len(i["skipped"]) for i in items)
    assert 4 <= skipped <= 6 and len(items) == 20
    reasons = " ".join(str(e) for i in items for e in i["skipped"])
    assert "00000.tar" in reasons and ("truncated" in reasons or "corrupt" in reasons)
    with pytest.raises(RecordError, match=r"00000\.tar \[sample #10\]: shard is truncated"):
        dataset(pattern)[9]


def test_not_a_tar_is_a_skip_or_an_error_naming_the_shard(tmp_path: Path) -> None:
    pattern = uneven_shards(tmp_path, sizes=(3, 3))
    (tmp_path / "00000.tar").write_bytes(b"")  # an empty object left by a failed upload
    with pytest.raises(RecordError, match=r"00000\.tar \[sample #1\]: .*truncated or not a tar"):
        dataset(pattern)[0]
    items = dataset(pattern, on_bad_record="skip").__getitems__([0, 1, 2])
    assert all(i["image_id"] >= 3 and len(i["skipped"]) == 1 for i in items)  # from the next shard


def test_missing_shard_is_an_error_also_under_skip(tmp_path: Path) -> None:
    pattern = uneven_shards(tmp_path, sizes=(3, 3))
    with pytest.raises(ShardError, match=r"00002\.tar' not found"):
        list_shards(pattern.replace("00001", "00002"))
    ds = dataset(pattern, on_bad_record="skip")
    os.remove(tmp_path / "00001.tar")
    with pytest.raises(ShardError, match=r"00001\.tar' not found"):
        ds[4]


def test_open_shards_stay_bounded(tmp_path: Path) -> None:
    ds = dataset(uneven_shards(tmp_path, sizes=(2,) * 12), open_shards=3)
    for i in range(24):
        ds[i]
    assert len(ds.cache) == 3
    assert len(os.listdir(f"/proc/{os.getpid()}/fd")) < 200
