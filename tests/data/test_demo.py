"""The synthetic demo dataset: deterministic, held-out compositions, unique eval captions, atomic cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from mm_lightning.assets import DEMO_BERT, resolve_pretrained
from mm_lightning.assets.demo_bert import build_demo_bert
from mm_lightning.data.demo import captions_for, generate_demo_dataset, is_complete

SMALL = {"image_size": 32, "train_renders": 1, "num_val": 20, "num_test": 20}


def _records(root: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()]


def test_generation_is_deterministic_and_complete(tmp_path: Path) -> None:
    a = generate_demo_dataset(tmp_path / "a", **SMALL)
    b = generate_demo_dataset(tmp_path / "b", **SMALL)
    for split in ("train", "val", "test"):
        assert (a / f"{split}.jsonl").read_bytes() == (b / f"{split}.jsonl").read_bytes()
    first_train_image = _records(a, "train")[0]["image"]
    assert (a / first_train_image).read_bytes() == (b / first_train_image).read_bytes()
    assert len(_records(a, "val")) == 20 and len(_records(a, "test")) == 20
    for record in _records(a, "train"):
        assert (a / record["image"]).is_file()
        assert isinstance(record["text"], list) and len(record["text"]) == 2


def test_eval_captions_unique_and_compositions_held_out(tmp_path: Path) -> None:
    root = generate_demo_dataset(tmp_path / "d", **SMALL)
    captions = {
        split: [c for r in _records(root, split) for c in r["text"]] for split in ("train", "val", "test")
    }
    for split in ("val", "test"):
        assert len(captions[split]) == len(set(captions[split])), f"duplicate captions in {split}"
    train = set(captions["train"])
    assert (
        not train & set(captions["val"])
        and not train & set(captions["test"])
        and not set(captions["val"]) & set(captions["test"])
    )


def test_interrupted_cache_is_rebuilt(tmp_path: Path) -> None:
    root = generate_demo_dataset(tmp_path / "d", **SMALL)
    params = {**json.loads((root / "MANIFEST.json").read_text())}
    params.pop("counts")
    assert is_complete(root, params)
    # Simulate a half-written cache: an image is lost and the manifest is gone.
    victim = root / _records(root, "val")[3]["image"]
    victim.unlink()
    assert not is_complete(root, params)
    (root / "MANIFEST.json").unlink()
    assert not is_complete(root, params)
    generate_demo_dataset(root, **SMALL)
    assert victim.is_file() and is_complete(root, params)
    # A complete cache is reused as is (same inode for the manifest: nothing rewritten).
    before = (root / "MANIFEST.json").stat().st_mtime_ns
    generate_demo_dataset(root, **SMALL)
    assert (root / "MANIFEST.json").stat().st_mtime_ns == before
    # Different parameters are not mistaken for a complete cache.
    generate_demo_dataset(root, **{**SMALL, "num_val": 10})
    assert len(_records(root, "val")) == 10
    assert not list(tmp_path.glob(".d.tmp-*")), "temporary build directories must not be left behind"


def test_shipped_demo_bert_matches_its_builder(tmp_path: Path) -> None:
    shipped = Path(resolve_pretrained(DEMO_BERT))
    rebuilt = build_demo_bert(tmp_path / "demo-bert")
    assert (
        AutoTokenizer.from_pretrained(shipped).get_vocab()
        == AutoTokenizer.from_pretrained(rebuilt).get_vocab()
    )
    assert AutoConfig.from_pretrained(shipped).to_diff_dict() | {
        "_name_or_path": ""
    } == AutoConfig.from_pretrained(rebuilt).to_diff_dict() | {"_name_or_path": ""}


def test_demo_tokenizer_covers_every_demo_caption(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(DEMO_BERT))
    root = generate_demo_dataset(tmp_path / "d", **SMALL)
    captions = [c for split in ("train", "val", "test") for r in _records(root, split) for c in r["text"]]
    ids = tokenizer(captions)["input_ids"]
    assert all(tokenizer.unk_token_id not in row for row in ids)
    # Control: a word outside the demo vocabulary does map to [UNK].
    assert tokenizer.unk_token_id in tokenizer("a small zebra")["input_ids"]
    assert resolve_pretrained("bert-base-uncased") == "bert-base-uncased"


@pytest.mark.parametrize("combo", [("star", "red", "small", "top left", "gray")])
def test_captions_name_every_attribute(combo: tuple[str, str, str, str, str]) -> None:
    for caption in captions_for(combo):
        for attribute in combo:
            assert attribute in caption
