"""Data audit: counts every defect kind, reads a full training config, exit code follows the threshold."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from mm_lightning.cli import main as cli_main
from tests.data.helpers import TOKENIZER, save_image, write_jsonl


def main(args: list[str]) -> int:
    return cli_main(["audit", *args])


def _dataset(root: Path) -> Path:
    images = root / "images"
    for i in range(4):
        save_image(images / f"{i}.jpg", (40 + i, 30), seed=i)
    shutil.copy(images / "0.jpg", images / "copy_of_0.jpg")  # duplicate content under another name
    (images / "broken.jpg").write_text("not a jpeg")
    long_caption = " ".join(["red"] * 40)
    rows: list[dict | str] = [
        {"image": "images/0.jpg", "text": ["a red circle", "a red circle"]},  # duplicate caption
        {"image": "images/1.jpg", "text": long_caption},  # overlong (> max_length 16)
        {"image": "images/2.jpg", "text": "a blue star"},
        {"image": "images/2.jpg", "text": "another blue star"},  # same image on a second line
        {"image": "images/copy_of_0.jpg", "text": "a green square"},
        {"image": "images/missing.jpg", "text": "gone"},
        {"image": "images/broken.jpg", "text": "broken"},
        "{oops",
        {"image": "images/3.jpg", "text": ""},
        {"image": "images/3.jpg"},
    ]
    return write_jsonl(root / "train.jsonl", rows)


def _config(root: Path, train: Path, **other_splits: Path) -> Path:
    """A full training config whose data reads ``train`` (and ``val=...``, ``test=...`` files)."""
    config = {
        "seed_everything": 1,
        "trainer": {  # a fit config's trainer section, callbacks too: the audit does not use it
            "max_epochs": 3,
            "accelerator": "cpu",
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": "x"}}
            ],
        },
        "model": {
            "image_tower": {"class_path": "mm_lightning.models.towers.TorchvisionTower"},
            "text_tower": {
                "class_path": "mm_lightning.models.towers.HFTextTower",
                "init_args": {"name": TOKENIZER},
            },
            "embed_dim": 8,
        },
        "data": {
            "class_path": "mm_lightning.data.MultimodalDataModule",
            "init_args": {
                "train_file": str(train),
                **{f"{split}_file": str(file) for split, file in other_splits.items()},
                "max_length": 16,
                "images": {"size": 32},
            },
        },
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(180)
def test_audit_report_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config(tmp_path, _dataset(tmp_path))
    out = tmp_path / "report.json"
    args = [
        "--config",
        str(config),
        "--audit.output",
        str(out),
        "--audit.workers",
        "1",
        "--audit.progress",
        "false",
    ]
    assert main(args) == 1  # default threshold 0: any error fails
    printed = (
        capsys.readouterr().out
    )  # the console names the first bad record of each kind: file:line: reason
    assert re.search(r"^    .*train\.jsonl:8: malformed JSON", printed, re.MULTILINE)
    rep = json.loads(out.read_text())["splits"]["train"]
    assert rep["records"] == 10
    assert rep["bad_lines"] == {
        "malformed_json": 1, "empty_caption": 1, "missing_key": 1, "missing_image": 1, "undecodable_image": 1,
    }  # fmt: skip
    assert rep["errors"] == 5
    assert rep["images"] == 6 and rep["missing_images"] == 1 and rep["undecodable_images"] == 1
    assert rep["lines_sharing_an_image"] == 1
    assert rep["duplicate_images_by_content"] == 1
    assert rep["duplicate_captions"] == 1 and rep["overlong_captions"] == 1
    assert rep["image_modes"] == {"RGB": 4} and sum(rep["image_short_side_histogram"].values()) == 4
    assert sum(rep["caption_tokens_histogram"].values()) == rep["captions"] == 8
    assert any("train.jsonl:8" in e for e in rep["examples"]["malformed_json"])
    assert any("missing.jpg" in e for e in rep["examples"]["missing_image"])
    # 5 errors / 10 records = 0.5: a threshold above passes, one below fails
    assert main([*args, "--audit.max_error_rate", "0.6"]) == 0
    assert main([*args, "--audit.max_error_rate", "0.4"]) == 1


@pytest.mark.timeout(180)
def test_audit_clean_data_passes_through_cli(tmp_path: Path) -> None:
    for i in range(3):
        save_image(tmp_path / f"{i}.png", seed=i)
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"image": f"{i}.png", "text": f"circle {i}"} for i in range(3)]
    )
    out = tmp_path / "r.json"
    code = cli_main(
        [
            "audit",
            "--config",
            str(_config(tmp_path, train)),
            "--audit.output",
            str(out),
            "--audit.workers",
            "1",
            "--audit.progress",
            "false",
        ]
    )
    assert code == 0
    assert json.loads(out.read_text())["errors"] == 0
