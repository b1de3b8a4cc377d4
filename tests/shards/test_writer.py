"""write_shards: JSONL + images -> img2dataset-layout shards that read back as the same samples; resumable."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mm_lightning.data.jsonl import JsonlIndex, RecordParser
from mm_lightning.data.records import RecordError
from mm_lightning.data.samples import ImageTextDataset, SampleBuilder
from mm_lightning.data.transforms import eval_transform
from mm_lightning.extras.shards.writer import write_shards
from tests.data.helpers import coco_style, save_image, write_jsonl
from tests.shards.helpers import shard_dataset


def parser(file: Path) -> RecordParser:
    return RecordParser(str(file), "image", "text", str(file.parent), False)


def test_layout_and_same_samples_as_the_jsonl_path(tmp_path: Path) -> None:
    file = coco_style(tmp_path / "data", num_images=7, captions_per_image=2)
    summary = write_shards(
        parser(file), str(tmp_path / "out"), samples_per_shard=3, workers=1, progress=False
    )
    assert (summary.shards, summary.samples, summary.written) == (3, 7, 3)
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == [
        "00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json", "00002.tar", "00002_stats.json",
        "shards.json",
    ]  # fmt: skip
    stats = json.loads((tmp_path / "out" / "00002_stats.json").read_text())
    assert stats["count"] == stats["successes"] == 1 and stats["status_dict"] == {"success": 1}

    shards = shard_dataset(str(tmp_path / "out" / "shards.json"), eval_transform(32), caption_sampling="all")
    jsonl = ImageTextDataset(
        JsonlIndex(parser(file)), SampleBuilder(eval_transform(32)), caption_sampling="all"
    )
    assert len(shards) == len(jsonl) == 14
    for i in range(14):
        a, b = shards[i], jsonl[i]
        assert a["caption"] == b["caption"] and torch.equal(a["image"], b["image"])
        assert a["image_id"] == b["image_id"]


def test_rerun_reuses_finished_shards_and_rewrites_changed_ones(tmp_path: Path) -> None:
    file = coco_style(tmp_path / "data", num_images=6, captions_per_image=1)
    out = str(tmp_path / "out")
    write_shards(parser(file), out, samples_per_shard=2, workers=1, progress=False)
    (tmp_path / "out" / "00001.tar").unlink()  # as if killed while writing it
    again = write_shards(parser(file), out, samples_per_shard=2, workers=1, progress=False)
    assert (again.written, again.reused) == (1, 2)
    lines = file.read_text().splitlines()
    lines[5] = lines[5].replace("version 0", "edited")
    file.write_text("\n".join(lines) + "\n")
    edited = write_shards(parser(file), out, samples_per_shard=2, workers=1, progress=False)
    assert (edited.written, edited.reused) == (1, 2)  # only the last shard's input changed


def test_bad_images_raise_with_line_or_are_counted(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_image(root / "ok.jpg")
    (root / "html.jpg").write_text("<html>error page</html>")
    rows = [
        {"image": "ok.jpg", "text": "fine"},
        {"image": "html.jpg", "text": "bad"},
        {"image": "gone.jpg", "text": "x"},
    ]
    with pytest.raises(RecordError, match=r"s\.jsonl:2 \(image '.*html\.jpg'\): image not written"):
        file = write_jsonl(root / "s.jsonl", rows)
        write_shards(parser(file), str(tmp_path / "a"), samples_per_shard=10, workers=1, progress=False)
    file = write_jsonl(root / "s.jsonl", rows + ["{not json"])
    summary = write_shards(
        parser(file),
        str(tmp_path / "b"),
        samples_per_shard=10,
        workers=1,
        progress=False,
        on_bad_record="skip",
    )
    assert (summary.samples, summary.failed_images, summary.skipped_lines) == (1, 2, 1)


def test_reencode_as_jpeg(tmp_path: Path) -> None:
    root = tmp_path / "data"
    save_image(root / "a.png")
    file = write_jsonl(root / "s.jsonl", [{"image": "a.png", "text": "a png"}])
    write_shards(parser(file), str(tmp_path / "out"), image_format="jpg", workers=1, progress=False)
    ds = shard_dataset(str(tmp_path / "out" / "{00000..00000}.tar"), eval_transform(32))
    record = ds.record(0)
    assert record.image_name.endswith(".jpg") and record.image[:2] == b"\xff\xd8"  # a JPEG now
    assert ds[0]["image"].shape == (3, 32, 32)


def test_concurrent_writers_of_one_json_file_never_collide(tmp_path: Path) -> None:
    """Two runs preparing one shared data folder rewrite shards.json at the same time: each renames its own
    complete temporary file (a shared .tmp name made one rename fail with FileNotFoundError)."""
    import threading

    from mm_lightning.extras.shards.writer import write_json_atomically

    path, errors = tmp_path / "shards.json", []

    def write(i: int) -> None:
        try:
            for _ in range(200):
                write_json_atomically(str(path), {"writer": i})
        except Exception as err:  # noqa: BLE001  (any failure is the finding)
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and [p.name for p in tmp_path.iterdir()] == ["shards.json"]
    assert json.loads(path.read_text())["writer"] in range(4)
    assert path.stat().st_mode & 0o044  # readable by others sharing the data (umask permitting)
