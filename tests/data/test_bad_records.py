"""Bad records: ``raise`` names file, line, image and reason; ``skip`` replaces, counts and keeps shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from mm_lightning.data import MultimodalDataModule, RecordError
from tests.data.helpers import TOKENIZER, natural_array, save_image, write_jsonl


def _make_defect(root: Path, kind: str) -> tuple[str | dict, str, str | None]:
    """Write the files for one defect; return (jsonl row, expected reason fragment, expected image name)."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    if kind == "malformed_json":
        return '{"image": "images/0.jpg", "text": "a cat"', "malformed JSON", None
    if kind == "missing_key":
        return {"img": "images/0.jpg", "text": "a cat"}, "missing key 'image'", None
    if kind == "non_string_caption":
        return {"image": "images/0.jpg", "text": 42}, "caption must be a string", "images/0.jpg"
    if kind == "empty_caption":
        return {"image": "images/0.jpg", "text": "   "}, "caption is empty", "images/0.jpg"
    if kind == "escaping_path":
        return {"image": "../outside.jpg", "text": "a cat"}, "escapes image_root", "../outside.jpg"
    if kind == "missing_file":
        return {"image": "images/gone.jpg", "text": "a cat"}, "not found", "gone.jpg"
    if kind == "zero_byte":
        (images / "empty.jpg").touch()
        return {"image": "images/empty.jpg", "text": "a cat"}, "empty (0 bytes)", "empty.jpg"
    if kind == "truncated_jpeg":
        save_image(images / "t.jpg", (64, 48), quality=90)
        data = (images / "t.jpg").read_bytes()
        (images / "t.jpg").write_bytes(data[: len(data) // 2])
        return {"image": "images/t.jpg", "text": "a cat"}, "truncated", "t.jpg"
    if kind == "not_an_image":
        (images / "fake.jpg").write_text("hello")
        return {"image": "images/fake.jpg", "text": "a cat"}, "not a decodable image", "fake.jpg"
    if kind == "decompression_bomb":
        Image.fromarray(natural_array(400, 400)).save(images / "bomb.png")
        return {"image": "images/bomb.png", "text": "a cat"}, "decompression bomb", "bomb.png"
    raise AssertionError(kind)


DEFECTS = [
    "malformed_json", "missing_key", "non_string_caption", "empty_caption", "escaping_path",
    "missing_file", "zero_byte", "truncated_jpeg", "not_an_image", "decompression_bomb",
]  # fmt: skip


def _split_with_defect(root: Path, kind: str) -> Path:
    for i in range(4):
        save_image(root / "images" / f"{i}.jpg", (40, 32), seed=i)
    bad_row, _, _ = _make_defect(root, kind)
    good = [{"image": f"images/{i}.jpg", "text": f"a red circle {i}"} for i in range(4)]
    return write_jsonl(root / "train.jsonl", [good[0], good[1], bad_row, good[2], good[3]])  # bad on line 3


def _dm(train: Path, mode: str, batch_size: int = 4) -> MultimodalDataModule:
    images = {"size": 32, "confine_to_root": True, "max_pixels": 100_000}
    return MultimodalDataModule(
        train_file=str(train), tokenizer=TOKENIZER, batch_size=batch_size, on_bad_record=mode, images=images,
        loader={"caption_sampling": "all"},
    )  # fmt: skip


@pytest.mark.parametrize("kind", DEFECTS)
def test_raise_names_file_line_image_and_reason(tmp_path: Path, kind: str) -> None:
    train = _split_with_defect(tmp_path, kind)
    _, reason, image = _make_defect(tmp_path, kind)
    dm = _dm(train, "raise")
    with pytest.raises(RecordError) as info:
        dm.setup("fit")
        for i in range(len(dm.datasets["train"])):
            dm.datasets["train"][i]
    err = info.value
    assert err.file == str(train) and err.line == 3
    message = str(err)
    assert f"{train}:3" in message and reason in message
    if image is not None:
        assert image in message


@pytest.mark.parametrize("kind", DEFECTS)
def test_skip_replaces_counts_and_keeps_batch_shape(tmp_path: Path, kind: str) -> None:
    train = _split_with_defect(tmp_path, kind)
    _, reason, _ = _make_defect(tmp_path, kind)
    dm = _dm(train, "skip")
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    # Record-level defects are dropped while indexing (4 valid items -> one batch of 4); file-level ones are
    # replaced at load time by another valid item (5 items -> one full batch of 4, the 5th dropped).
    assert [b["image"].shape[0] for b in batches] == [4]
    errors = dm.index_skips.count + sum(len(b["skipped"]) for b in batches)
    reasons = dm.index_skips.first + [str(e) for b in batches for e in b["skipped"]]
    if dm.index_skips.count:
        assert errors == 1
    else:  # the bad item is visited once per epoch unless the shuffle dropped it as the 5th item
        assert len(dm.datasets["train"]) == 5
        assert errors in (0, 1)
        full = [dm.datasets["train"][i] for i in range(5)]
        assert [len(s["skipped"]) for s in full] == [0, 0, 1, 0, 0]
        assert full[2]["index"] in (0, 1, 3, 4)  # replaced by a valid item, which keeps its own index
        err = full[2]["skipped"][0]
        assert (
            isinstance(err, RecordError)
            and err.line == 3
            and err.kind in ("missing_image", "undecodable_image")
        )
        reasons = [str(err)]
    assert any(f"{train}:3" in r and reason in r for r in reasons)


def test_symlink_escaping_root_is_rejected(tmp_path: Path) -> None:
    outside = save_image(tmp_path / "outside.jpg")
    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    os.symlink(outside, root / "images" / "link.jpg")
    train = write_jsonl(root / "train.jsonl", [{"image": "images/link.jpg", "text": "a cat"}])
    dm = _dm(train, "raise")
    dm.setup("fit")
    with pytest.raises(RecordError, match="escapes image_root"):
        dm.datasets["train"][0]
    dm_free = MultimodalDataModule(train_file=str(train), tokenizer=TOKENIZER, images={"size": 32})  # control
    dm_free.setup("fit")
    assert dm_free.datasets["train"][0]["image"].shape == (3, 32, 32)


def test_absolute_paths_allowed_without_confinement(tmp_path: Path) -> None:
    img = save_image(tmp_path / "elsewhere" / "a.jpg")
    train = write_jsonl(tmp_path / "data" / "train.jsonl", [{"image": str(img), "text": "a cat"}])
    dm = MultimodalDataModule(train_file=str(train), tokenizer=TOKENIZER, images={"size": 32})
    dm.setup("fit")
    assert dm.datasets["train"][0]["image"].shape == (3, 32, 32)
    confined = _dm(train, "raise")
    with pytest.raises(RecordError, match="escapes image_root"):
        confined.setup("fit")
