"""``python -m mm_lightning shard`` (JSONL -> shards) and ``audit`` on shards, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from mm_lightning.cli import main
from tests.data.helpers import TOKENIZER, coco_style
from tests.shards.helpers import write_shard


def config(root: Path, data: dict) -> str:
    model = {
        "image_tower": {"class_path": "mm_lightning.models.towers.TorchvisionTower"},
        "text_tower": {
            "class_path": "mm_lightning.models.towers.HFTextTower",
            "init_args": {"name": TOKENIZER},
        },
        "embed_dim": 8,
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump({"model": model, "data": data}))
    return str(path)


def test_shard_command_converts_every_split_and_resumes(tmp_path: Path) -> None:
    train = coco_style(tmp_path / "train", num_images=5, captions_per_image=2)
    val = coco_style(tmp_path / "val", num_images=2, captions_per_image=1)
    data = {
        "class_path": "mm_lightning.data.MultimodalDataModule",
        "init_args": {"train_file": str(train), "val_file": str(val)},
    }
    args = ["shard", "--config", config(tmp_path, data), "--out", str(tmp_path / "out")]
    args += ["--samples_per_shard", "2", "--workers", "1", "--progress", "false"]
    assert main(args) == 0
    listing = json.loads((tmp_path / "out" / "train" / "shards.json").read_text())
    assert [s["nsamples"] for s in listing["shardlist"]] == [2, 2, 1]
    assert json.loads((tmp_path / "out" / "val" / "shards.json").read_text())["shardlist"][0]["nsamples"] == 2
    stamp = (tmp_path / "out" / "train" / "00000.tar").stat().st_mtime_ns
    assert main(args) == 0
    assert (tmp_path / "out" / "train" / "00000.tar").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_audit_reads_shards_and_names_bad_samples(tmp_path: Path) -> None:
    write_shard(tmp_path / "s" / "00000.tar", 0, 3, broken={1: b"<html>not an image</html>"})
    write_shard(tmp_path / "s" / "00001.tar", 3, 2)
    data = {
        "class_path": "mm_lightning.extras.ShardDataModule",
        "init_args": {"train_shards": str(tmp_path / "s" / "{00000..00001}.tar"), "max_length": 16},
    }
    out = tmp_path / "report.json"
    args = ["audit", "--config", config(tmp_path, data), "--audit.output", str(out)]
    assert main([*args, "--audit.workers", "1", "--audit.progress", "false"]) == 1
    report = json.loads(out.read_text())["splits"]["train"]
    assert (report["records"], report["errors"], report["shards"]) == (5, 1, 2)
    assert report["bad_lines"] == {"undecodable_image": 1}
    assert "00000.tar [sample 000000001]" in report["examples"]["undecodable_image"][0]
    assert report["captions"] == 8 and report["duplicate_images_by_content"] == 0
