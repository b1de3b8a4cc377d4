"""Skip accounting: each bad record counted once per pass, replacements spread over distinct valid records,
a configurable replacement limit, and evaluation rows that are the valid records once deduplicated by index."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from mm_lightning.data import MultimodalDataModule, TooManyBadRecords
from mm_lightning.data.records import RecordError
from mm_lightning.data.skips import SkipLog
from tests.data.helpers import TOKENIZER, one_bad_image_with_five_captions, save_image, write_jsonl


def _split(root: Path, layout: str) -> Path:
    """One record per character of ``layout``: ``g`` a valid image, ``b`` a missing one, ``j`` bad JSON."""
    rows: list[dict | str] = []
    for i, c in enumerate(layout):
        if c == "g":
            save_image(root / "images" / f"{i}.jpg", (20, 16), seed=i)
            rows.append({"image": f"images/{i}.jpg", "text": [f"photo {i} first", f"photo {i} second"]})
        elif c == "b":
            rows.append({"image": f"images/missing{i}.jpg", "text": f"gone {i}"})
        else:
            rows.append("{not json")
    return write_jsonl(root / f"{layout[:8]}-{len(layout)}.jsonl", rows)


def _dm(path: Path, **kwargs: object) -> MultimodalDataModule:
    args = {"tokenizer": TOKENIZER, "images": {"size": 16}, "batch_size": 4, "on_bad_record": "skip"} | kwargs
    return MultimodalDataModule(train_file=str(path), val_file=str(path), **args)


def _epoch(dataset: torch.utils.data.Dataset, batch_size: int) -> list[dict]:
    items = list(range(len(dataset)))
    return [
        s for i in range(0, len(items), batch_size) for s in dataset.__getitems__(items[i : i + batch_size])
    ]


def test_a_run_of_bad_records_is_counted_once_each(tmp_path: Path) -> None:
    path = _split(tmp_path, "g" * 6 + "b" * 7 + "g" * 6)
    dm = _dm(path)
    dm.setup("fit")
    samples = _epoch(dm.datasets["val"], 4)
    lines = Counter(err.line for s in samples for err in s["skipped"])
    # 7 bad records, once each (walking forward through the run would count 7 + 6 + ... + 1 = 28)
    assert lines == Counter(range(7, 14))
    assert len(samples) == len(dm.datasets["val"])  # batch shapes kept


def test_replacements_spread_over_distinct_valid_records(tmp_path: Path) -> None:
    path = _split(tmp_path, "g" * 24 + "b" * 8 + "g" * 8)
    dm = _dm(path, loader={"caption_sampling": "random"})
    dm.setup("fit")
    train = dm.datasets["train"]
    # One batch holding the whole bad run: stand-ins are distinct and not already in the batch.
    batch_items = list(range(20, 36))
    samples = train.__getitems__(batch_items)
    stand_ins = [s["index"] for s, item in zip(samples, batch_items, strict=True) if s["skipped"]]
    assert len(stand_ins) == 8 and len(set(stand_ins)) == 8
    assert not set(stand_ins) & set(batch_items)
    # Bad items visited one by one (different batches) do not all land on the same neighbour either.
    singles = [train[item]["index"] for item in range(24, 32)]
    assert len(set(singles)) >= 6 and Counter(singles).most_common(1)[0][1] <= 2


def test_replacement_limit_is_configurable(tmp_path: Path) -> None:
    path = _split(tmp_path, "b" * 100 + "g" * 10)
    strict = _dm(path, loader={"max_replacements": 0})
    strict.setup("fit")
    with pytest.raises(TooManyBadRecords, match=r"missing0\.jpg.*\n.*--data\.loader\.max_replacements"):
        strict.datasets["val"][0]
    patient = _dm(path, loader={"max_replacements": 400})
    patient.setup("fit")
    samples = _epoch(patient.datasets["val"], 16)
    assert sum(len(s["skipped"]) for s in samples) == 100
    assert {s["index"] for s in samples} == set(range(100, 120))  # 10 valid images x 2 captions


def test_eval_rows_deduplicated_by_index_are_the_valid_records(tmp_path: Path) -> None:
    """What the metrics see under ``skip`` (after dropping repeated indices) equals the valid-only file."""
    hostile = _split(tmp_path, "gbgjgbbg")
    valid_lines = [
        line
        for line in hostile.read_text().splitlines()
        if "images/missing" not in line and "{not" not in line
    ]
    clean = hostile.with_name("clean.jsonl")
    clean.write_text("\n".join(valid_lines) + "\n")
    rows = {}
    for name, path in (("hostile", hostile), ("clean", clean)):
        dm = _dm(path)
        dm.setup("validate")
        seen: dict[int, dict] = {}
        for batch in dm.val_dataloader():
            dm.normalize_batch(batch)
            for r, index in enumerate(batch["index"].tolist()):
                seen.setdefault(index, {k: batch[k][r] for k in ("image", "image_id", "input_ids")})
        rows[name] = [seen[index] for index in sorted(seen)]  # file order, bad records left out
    assert len(rows["hostile"]) == len(rows["clean"]) == 8  # 4 valid images x 2 captions
    for a, b in zip(rows["hostile"], rows["clean"], strict=True):
        assert torch.equal(a["image"], b["image"])
        n = int((a["input_ids"] != 0).sum())
        assert torch.equal(a["input_ids"][:n], b["input_ids"][:n])
    # the same captions-per-image grouping (the retrieval ground truth)
    groups = {name: sorted(Counter(int(r["image_id"]) for r in rs).values()) for name, rs in rows.items()}
    assert groups["hostile"] == groups["clean"] == [2, 2, 2, 2]


@pytest.mark.parametrize("caption_sampling", ["all", "random"])
def test_a_bad_image_counts_each_record_that_names_it_once_a_pass(
    tmp_path: Path, caption_sampling: str
) -> None:
    path = one_bad_image_with_five_captions(tmp_path)
    dm = _dm(path, loader={"caption_sampling": caption_sampling})
    dm.setup("fit")
    train = dm.datasets["train"]
    # a pass that reads only some of its pairs (as one whose last partial batch is dropped): items 0-5 hold 3 of
    # the 5 in "all"; in "random" the image is one item
    read = train.__getitems__(list(range(6)) if caption_sampling == "all" else list(range(len(train))))
    errors = [err for sample in read for err in sample["skipped"]]
    assert len(errors) == (3 if caption_sampling == "all" else 1)  # control: one error per failed load
    assert all(err.lines == (4, 5, 6, 7, 8) for err in errors)
    log = SkipLog()
    for err in errors:
        log.add(err, "train")
    assert log.count == 5 and log.by_kind() == {"undecodable_image": 5}
    log.end_pass("train")
    assert log.count == 5 and not log.pending
    # the next pass counts them again
    log.add(errors[0], "train")
    assert log.count == 10 and log.by_split() == {"train": 10}
    # two ranks that each read one of its pairs count its records once between them
    ranks = [SkipLog(), SkipLog()]
    ranks[0].add(errors[0], "val")
    ranks[1].add(errors[-1], "val")
    assert sum(r.count for r in ranks) == 10  # control: not joined, each rank counts all 5
    joined = SkipLog()
    joined.end_pass("val", [r.pending["val"] for r in ranks])
    assert joined.count == 5 and joined.by_split() == {"val": 5}


def test_a_bad_record_survives_the_trip_from_a_worker_with_its_lines() -> None:
    import pickle

    err = RecordError("a.jsonl", 4, "bad", "x.jpg", lines=(4, 9))
    back = pickle.loads(pickle.dumps(err))
    assert (back.lines, back.kind, str(back)) == ((4, 9), "undecodable_image", str(err))
    assert RecordError("a.jsonl", 3, "bad").lines == (3,) and RecordError("s.tar", None, "bad").lines == ()
