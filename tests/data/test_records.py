"""JsonlIndex: compact arrays (no per-record Python objects), ids, offsets, blank lines."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from mm_lightning.data.jsonl import JsonlIndex, RecordParser
from mm_lightning.data.records import RecordError


def _index(path: Path, **kwargs: object) -> JsonlIndex:
    return JsonlIndex(RecordParser(str(path), "image", "text", str(path.parent), False), **kwargs)


def test_index_is_arrays_of_a_few_bytes_per_line(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    lines = 20_000
    with open(path, "w") as f:
        for i in range(lines):
            f.write(
                json.dumps({"image": f"img/{i // 5:08d}.jpg", "text": f"a caption number {i} here"}) + "\n"
            )
    index = _index(path)
    assert index.num_captions == lines and index.num_images == lines // 5
    # every attribute holding per-line data is a numpy array (one object: no copy-on-access in workers)
    per_line = [v for v in vars(index).values() if hasattr(v, "__len__") and not isinstance(v, str | bytes)]
    assert per_line and all(isinstance(v, np.ndarray) for v in per_line if len(v) >= lines // 5)
    assert sum(v.nbytes for v in per_line if isinstance(v, np.ndarray)) / lines < 48
    # what a worker receives is as small (a list of dicts pickles to > 60 bytes per line)
    assert len(pickle.dumps(index)) / lines < 48
    rows = [json.loads(line) for line in open(path)]
    assert len(pickle.dumps(rows)) / lines > 60  # control: the layout this replaces


def test_reads_lines_back_by_offset_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(
        json.dumps({"image": "a.jpg", "text": ["one", "two"]})
        + "\n\n   \n"
        + json.dumps({"image": "b.jpg", "text": "three"})
        + "\n"
        + json.dumps({"image": "a.jpg", "text": "four"})
    )  # no trailing newline on the last line
    index = _index(path)
    assert index.line_numbers.tolist() == [1, 4, 5]
    assert index.num_captions == 4 and index.image_ids.tolist() == [0, 0, 1, 0]
    assert [index.read(i).captions for i in range(3)] == [["one", "two"], ["three"], ["four"]]
    assert index.read(1).image == str(tmp_path / "b.jpg")
    # captions grouped by image: image 0 owns caption rows 0, 1, 3
    group = index.by_image[index.starts[0] : index.starts[1]].tolist()
    assert sorted(group) == [0, 1, 3]


def test_skip_mode_counts_and_keeps_first_reasons(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(["{bad"] * 30 + [json.dumps({"image": "a.jpg", "text": "ok"})]) + "\n")
    index = _index(path, on_bad_record="skip")
    assert index.skips.count == 30 and len(index.skips.first) == 20
    assert index.num_captions == 1 and "bad.jsonl:1" in index.skips.first[0]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"image": "a.jpg", "text": "cut', "Unterminated string starting at column 28"),
        (b'{"image": "a.jpg", "text": "tab\there"}', "Invalid control character at column 32"),
        (
            b'{"image": "a.jpg" "text": "x"}',
            "Expecting ',' delimiter at column 19",
        ),  # the control: no "at" to drop
    ],
)
def test_json_errors_say_at_once(tmp_path: Path, line: bytes, expected: str) -> None:
    parser = RecordParser(str(tmp_path / "x.jsonl"), "image", "text", str(tmp_path), False)
    with pytest.raises(RecordError) as info:
        parser.parse(line, 3)
    assert str(info.value) == f"{tmp_path / 'x.jsonl'}:3: malformed JSON: {expected}"
