"""Hostile input: every case is a clear error under ``raise`` and one counted skip under ``skip``; the audit
agrees with training on every record; the command line reports skips in every stage and fails early and
clearly on files without a valid record.

The cases (``tests/data/hostile.py``) are what scraped web data contains: HTML error pages saved as ``.jpg``,
0-byte and truncated files, wrong extensions, decompression bombs, NUL bytes and lone surrogates in paths,
links leaving the image root, FIFOs, JSON nested 100,000 deep, 5000-digit numbers, 40,000 captions...
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_lightning.data import MultimodalDataModule, RecordError, SkipLog
from mm_lightning.data.audit import audit
from tests.data.helpers import TOKENIZER
from tests.data.hostile import CASES, Case, good_line, write_case_file

BAD_CASES = [c for c in CASES if c.kind is not None]


def _dm(path: Path, mode: str, **kwargs: object) -> MultimodalDataModule:
    args = {"tokenizer": TOKENIZER, "image_size": 16, "batch_size": 3, "caption_sampling": "random"}
    return MultimodalDataModule(
        train_file=str(path), on_bad_record=mode, confine_to_root=True, **(args | kwargs)
    )


def _between_good_lines(root: Path, case: Case) -> Path:
    """good, hostile, good: the hostile record is on line 2."""
    return write_case_file(root, [good_line(root, 0), case.make(root), good_line(root, 1)])


def _load_all(dm: MultimodalDataModule) -> list[dict]:
    dm.setup("fit")
    dataset = dm.datasets["train"]
    return dataset.__getitems__(list(range(len(dataset))))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_raise_mode_names_file_line_kind_or_accepts(tmp_path: Path, case: Case) -> None:
    path = _between_good_lines(tmp_path / "data", case)
    dm = _dm(path, "raise")
    if case.kind is None:  # odd but valid: loads, collates and tokenizes like any record
        samples = _load_all(dm)
        assert len(samples) == 3 and all(s["image"].shape == (3, 16, 16) for s in samples)
        batch = dm.collate(samples)
        assert batch["input_ids"].shape[0] == 3 and batch["input_ids"].shape[1] <= dm.hparams.max_length
        return
    with pytest.raises(RecordError) as info:
        _load_all(dm)
    err = info.value
    assert (err.file, err.line, err.kind) == (str(path), 2, case.kind), str(err)
    assert str(err).startswith(f"{path}:2") and err.reason


@pytest.mark.parametrize("case", BAD_CASES, ids=[c.name for c in BAD_CASES])
def test_skip_mode_counts_each_bad_record_once(tmp_path: Path, case: Case) -> None:
    path = _between_good_lines(tmp_path / "data", case)
    dm = _dm(path, "skip")
    samples = _load_all(dm)
    errors = SkipLog()
    errors.update(dm.index_skips)
    for sample in samples:
        for err in sample["skipped"]:
            errors.add(err)
            assert err.line == 2 and err.file == str(path)
    assert errors.count == 1 and errors.by_kind() == {case.kind: 1}, errors.summary()
    # What remains is the two valid records (a stand-in for the bad one carries a valid record's own index).
    captions = {s["caption"] for s in samples}
    assert captions == {"a good photo number 0", "a good photo number 1"}
    batch = dm.collate(samples)  # dropped while indexing: 2 samples; found at load time: 3, one stand-in
    assert batch["image"].shape[0] == len(samples) and len(batch["skipped"]) == len(samples) - 2


def test_forty_thousand_captions_keep_their_positions(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "forty_thousand_captions")
    path = write_case_file(tmp_path, [case.make(tmp_path)])
    dm = _dm(path, "raise", val_file=str(path))
    dm.setup("validate")
    index = dm.datasets["val"].index
    assert index.num_captions == 40_000 and index.num_images == 1
    assert index.pair(39_999).caption == "caption 39999"  # past int16's 32,767


def test_audit_agrees_with_training_on_every_record(tmp_path: Path) -> None:
    root = tmp_path / "data"
    lines = [good_line(root, 0)] + [case.make(root) for case in CASES] + [good_line(root, 1)]
    path = write_case_file(root, lines)
    expected = {i + 2: c.kind for i, c in enumerate(CASES) if c.kind is not None}

    dm = _dm(path, "skip")
    trained = {}
    for sample in _load_all(dm):
        for err in sample["skipped"]:
            assert err.file == str(path)
            trained[err.line] = err.kind
    trained.update(_index_errors(dm))
    assert trained == expected

    report = audit(dm, ["train"], workers=2, progress=False)["splits"]["train"]
    audited = {line: kind for line, kind in report["bad_records"]}
    assert audited == expected
    assert report["records"] == len(lines) and report["errors"] == len(expected)


def _index_errors(dm: MultimodalDataModule) -> dict[int, str]:
    """Line -> kind of the lines the index dropped (the index re-parses with the same parser)."""
    parser = dm.record_parser("train")
    out = {}
    with open(parser.file, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                parser.parse(raw, line_no)
            except RecordError as err:
                out[line_no] = err.kind
    assert len(out) == dm.index_skips.count
    return out
