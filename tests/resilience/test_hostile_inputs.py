"""Hostile input: every case is a clear error under ``raise`` and one counted skip under ``skip``; the audit
agrees with training on every record; the command line reports skips in every stage and fails early and
clearly on files without a valid record.

The cases (``tests/data/hostile.py``) are what scraped web data contains: HTML error pages saved as ``.jpg``,
0-byte and truncated files, wrong extensions, decompression bombs, NUL bytes and lone surrogates in paths,
links leaving the image root, FIFOs, JSON nested 100,000 deep, 5000-digit numbers, 40,000 captions...
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mm_lightning.cli import cli_main, main
from mm_lightning.commands.audit import audit
from mm_lightning.data import EmptySplitError, MultimodalDataModule, NoTrainingBatch, RecordError, SkipLog
from tests import preloaded
from tests.conftest import DEMO_CONFIG, LONG_RUN_CALLBACKS, callback_args
from tests.data.helpers import TOKENIZER
from tests.data.hostile import CASES, Case, good_line, write_case_file

BAD_CASES = [c for c in CASES if c.kind is not None]


def _dm(path: Path, mode: str, **kwargs: object) -> MultimodalDataModule:
    args = {"train_file": str(path), "tokenizer": TOKENIZER, "batch_size": 3}
    args |= {"images": {"size": 16, "confine_to_root": True}, "loader": {"caption_sampling": "random"}}
    return MultimodalDataModule(on_bad_record=mode, **(args | kwargs))


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


@pytest.mark.parametrize("split", ["train", "val", "test", "predict"])
@pytest.mark.parametrize("content", ["empty", "all_bad"])
def test_split_without_valid_record_fails_early(tmp_path: Path, split: str, content: str) -> None:
    root = tmp_path / "data"
    bad = (
        write_case_file(root, [b"", b"  "], "empty.jsonl")
        if content == "empty"
        else _between_good_lines(root, next(c for c in CASES if c.name == "json_null"))
    )
    if content == "all_bad":  # keep only the bad line
        bad.write_bytes(bad.read_bytes().splitlines(keepends=True)[1])
    good = _between_good_lines(tmp_path / "good", next(c for c in CASES if c.name == "valid_jpeg"))
    dm = _dm(good, "skip", **{f"{split}_file": str(bad)})
    stage = {"train": "fit", "val": "validate", "test": "test", "predict": "predict"}[split]
    with pytest.raises(EmptySplitError, match=rf"^{split}_file {bad}: 0 valid records found"):
        dm.setup(stage)


def test_a_caption_the_tokenizer_rejects_is_named(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "caption_html_emoji_rtl")
    path = _between_good_lines(tmp_path, case)
    dm = _dm(path, "raise")
    samples = _load_all(dm)
    tokenizer = dm.collate.tokenizer

    def picky(captions: list[str], **kwargs: object) -> object:  # a tokenizer with a bug on one caption
        if any("🐱" in c for c in captions):
            raise IndexError("piece id out of range")
        return tokenizer(captions, **kwargs)

    dm.collate._tokenizer = picky
    with pytest.raises(RecordError, match=rf"^{path}:2 .*tokenizer rejects .*IndexError: piece id") as info:
        dm.collate(samples)
    assert info.value.kind == "bad_caption"


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


# --- through the command line ---------------------------------------------------------------------------------

CLI_TRAIN_BAD = ["nul_in_path", "deep_nesting", "html_error_page", "fifo", "symlink_escaping_root"]
CLI_VAL_BAD = ["five_thousand_digit_int", "zero_byte"]


def _split(root: Path, name: str, good: int, bad: list[str], first: int = 0) -> Path:
    cases = {c.name: c for c in CASES}
    lines = [good_line(root, first + i) for i in range(good)] + [cases[n].make(root) for n in bad]
    return write_case_file(root, lines, f"{name}.jsonl")


def _cli_config(tmp_path: Path, mode: str, **files: Path) -> list[str]:
    """The demo model on tiny hostile splits: ``fit``/``validate``/... arguments after the subcommand."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["trainer"]["callbacks+"] = str(LONG_RUN_CALLBACKS)  # a long run's, after the defaults
    config["data"] = {
        "class_path": "mm_lightning.data.MultimodalDataModule",
        "init_args": {
            **{f"{split}_file": str(path) for split, path in files.items()},
            "batch_size": 4, "num_workers": 0, "on_bad_record": mode,
            "images": {"size": 32, "confine_to_root": True}, "loader": {"caption_sampling": "all"},
        },
    }  # fmt: skip
    path = tmp_path / f"config-{mode}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return [
        "--config", str(path),
        "--trainer.max_epochs", "1",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path),  # logs in tmp_path/version_N, checkpoints in .../checkpoints
    ]  # fmt: skip


def _scalars(log_dir: str, tag: str) -> list[float]:
    return [e.value for e in EventAccumulator(log_dir).Reload().Scalars(tag)]


@pytest.mark.timeout(300)
def test_cli_skip_counts_and_summarizes_in_every_stage(tmp_path: Path) -> None:
    root = tmp_path / "data"
    # 9 valid + 3 bad images = 12 items = 3 full batches of 4; 2 more lines are dropped while indexing.
    train = _split(root, "train", 9, CLI_TRAIN_BAD)
    val = _split(root, "val", 5, CLI_VAL_BAD, first=100)  # 1 line dropped, 1 bad image among 6 items
    args = _cli_config(tmp_path, "skip", train=train, val=val, test=val, predict=val)
    with pytest.warns(UserWarning, match=r"7 bad records skipped \(train 5, val 2"):
        cli = cli_main(["fit", *args])
    log_dir = cli.trainer.logger.log_dir
    # cumulative per step: 3 lines dropped while indexing (train 2, val 1) + the 3 bad images as batches meet them
    steps = _scalars(log_dir, "data/skipped")
    assert len(steps) == 3 and steps[0] >= 3.0 and steps == sorted(steps) and steps[-1] == 6.0
    summary = EventAccumulator(log_dir).Reload().Tensors("data/skipped_summary/text_summary")[0]
    text = summary.tensor_proto.string_val[0].decode()
    for kind in ("malformed_json", "bad_path", "undecodable_image", "path_escapes_root"):
        assert kind in text
    assert f"{train}:10" in text  # file and line of the first bad train record

    ckpt = str(tmp_path / "checkpoints" / "last.ckpt")
    for stage in ("validate", "test"):
        with pytest.warns(UserWarning, match=r"2 bad records skipped \((val|test) 2"):
            cli = cli_main([stage, *args, "--ckpt_path", ckpt])
        assert float(cli.trainer.callback_metrics["data/skipped"]) == 2.0
    with pytest.warns(UserWarning, match=r"2 bad records skipped \(predict 2"):
        cli_main(["predict", *args, "--ckpt_path", ckpt, *callback_args(tmp_path, EmbeddingWriter={"output_dir": str(tmp_path / "pred")})])  # fmt: skip
    rows = torch.load(tmp_path / "pred" / "embeddings_rank0.pt", weights_only=True)["index"]
    # items 0-4 are valid; item 5 (the empty image) was replaced by a copy of a valid item, left out of the file
    assert sorted(rows.tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.timeout(300)
def test_cli_raise_names_file_and_line(tmp_path: Path) -> None:
    root = tmp_path / "data"
    train = _split(root, "train", 4, ["html_error_page"])
    with pytest.raises(RecordError, match=rf"{train}:5 \(image '.*html.jpg'\): not a decodable image"):
        cli_main(["fit", *_cli_config(tmp_path, "raise", train=train), "--trainer.max_steps", "1"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("split", "content"), [("train", "empty"), ("val", "all_bad")])
def test_cli_split_without_valid_record_fails_early(tmp_path: Path, split: str, content: str) -> None:
    root = tmp_path / "data"
    files = {"train": _split(root, "train", 4, []), "val": _split(root, "val", 4, [], first=10)}
    files[split] = (
        write_case_file(root, [b"", b"  "], "empty.jsonl")
        if content == "empty"
        else _split(root, "bad", 0, ["deep_nesting", "nul_in_path", "json_null"])
    )
    with pytest.raises(EmptySplitError, match=rf"{split}_file {files[split]}: 0 valid records found") as info:
        cli_main(["fit", *_cli_config(tmp_path, "skip", **files), "--trainer.max_steps", "1"])
    if split == "val":
        assert "no best checkpoint" in str(info.value)
    if content == "all_bad":
        assert "3 bad" in str(info.value) and "malformed JSON" in str(info.value)


@pytest.mark.timeout(300)
def test_cli_audit_reports_what_fit_skips(tmp_path: Path) -> None:
    root = tmp_path / "data"
    train = _split(root, "train", 3, CLI_TRAIN_BAD)
    out = tmp_path / "audit.json"
    args = [*_cli_config(tmp_path, "skip", train=train), "--audit.output", str(out), "--audit.workers", "1"]
    from mm_lightning.cli import main

    assert main(["audit", *args, "--audit.progress", "false"]) == 1
    report = json.loads(out.read_text())["splits"]["train"]
    kinds = {c.name: c.kind for c in CASES}
    assert report["bad_records"] == [[4 + i, kinds[name]] for i, name in enumerate(CLI_TRAIN_BAD)]


@pytest.mark.timeout(300)
def test_cli_validation_metrics_under_skip_equal_the_valid_records_alone(tmp_path: Path) -> None:
    root = tmp_path / "data"
    hostile = _split(root, "hostile", 6, ["zero_byte", "html_error_page", "deep_nesting", "fifo"], first=200)
    clean = _split(root, "clean", 6, [], first=200)
    metrics = {}
    # One pair per batch: stand-ins change how valid rows are batched, and with other batch shapes an untrained
    # model's near-tied similarities can swap ranks by float rounding alone. Without the de-duplication of
    # stand-ins by index the hostile run scores extra gallery rows and its recalls differ.
    for name, path in (("hostile", hostile), ("clean", clean)):
        cli = cli_main(
            [
                "validate",
                *_cli_config(tmp_path / name, "skip", train=path, val=path),
                "--data.init_args.batch_size",
                "1",
            ]
        )
        metrics[name] = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if "/r" in k}
    assert metrics["clean"] and metrics["hostile"] == metrics["clean"]


@pytest.mark.timeout(300)
def test_cli_validation_loss_under_skip_equals_the_valid_records_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``val/loss`` leaves out the rows that stand in for broken images (as rows and as negatives)."""
    root = tmp_path / "data"
    broken = ["zero_byte", "html_error_page", "fifo", "zero_byte"]
    hostile = _split(root, "hostile", 8, broken, first=300)
    clean = _split(root, "clean", 8, [], first=300)

    def validate(name: str, path: Path) -> dict[str, float]:
        args = _cli_config(tmp_path / name, "skip", train=path, val=path)
        cli = cli_main(["validate", *args, "--data.init_args.batch_size", "16"])  # one batch holds every row
        return {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}

    clean_metrics = validate("clean", clean)
    hostile_metrics = validate("hostile", hostile)
    assert "val/loss" in clean_metrics and hostile_metrics == pytest.approx(clean_metrics, abs=1e-6)

    # control: counting every row (as the loss did before) gives another val/loss
    from mm_lightning.evaluation.validation import EvalRows

    monkeypatch.setattr(
        EvalRows, "keep", lambda self, index, stand_in: torch.ones_like(index, dtype=torch.bool)
    )
    counted = validate("counted", hostile)
    assert abs(counted["val/loss"] - clean_metrics["val/loss"]) > 1e-3, (counted, clean_metrics)


def _run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return preloaded.run(
        [sys.executable, "-m", "mm_lightning", *args],
        capture_output=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 1])
def test_cli_error_is_the_last_lines_without_a_traceback(
    tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raise-mode bad record, in the main process or a DataLoader worker: reason + fix, exit code 1; the
    traceback only on request."""
    root = tmp_path / "data"
    train = _split(root, "train", 4, ["html_error_page"])
    args = [
        "fit", *_cli_config(tmp_path, "raise", train=train), "--trainer.max_steps", "1",
        "--data.init_args.num_workers", str(workers),
    ]  # fmt: skip
    result = _run_cli(*args)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-3:]
    assert re.match(
        rf"error: RecordError: {re.escape(str(train))}:5 \(image '.*html\.jpg'\): not a decodable", last[0]
    )
    assert "--data.init_args.on_bad_record skip" in last[1] and "MM_LIGHTNING_TRACEBACK=1" in last[2]
    if (
        workers
    ):  # control (once, in this process): asked for, the error itself leaves main() with its traceback
        monkeypatch.setenv("MM_LIGHTNING_TRACEBACK", "1")
        with pytest.raises(RuntimeError, match=r"(?s)RecordError.*html\.jpg"):
            main(args)


@pytest.mark.timeout(300)
def test_cli_fit_refuses_a_training_split_without_one_full_batch(tmp_path: Path) -> None:
    """3 lines fail while reading, 2 broken images are left for a batch of 4: no step could run, so fit stops
    (it used to end "successfully" with no training batch), saying what was read and what was never loaded."""
    root = tmp_path / "data"
    bad = ["deep_nesting", "nul_in_path", "json_null", "html_error_page", "zero_byte"]
    train = _split(root, "train", 0, bad)
    with pytest.raises(NoTrainingBatch) as info:
        cli_main(["fit", *_cli_config(tmp_path / "a", "skip", train=train), "--trainer.max_steps", "1"])
    message = str(info.value)
    assert f"{train}: 5 non-blank lines, 3 dropped while reading, 2 caption rows left" in message, message
    assert "batch_size 4" in message and "never loaded" in message
    # control: with four more valid records there is one batch and fit trains
    enough = _split(root, "enough", 4, bad)
    cli = cli_main(["fit", *_cli_config(tmp_path / "b", "skip", train=enough), "--trainer.max_steps", "1"])
    assert cli.trainer.global_step == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_predict_on_two_processes_writes_each_valid_record_once(tmp_path: Path) -> None:
    """4 broken images among 11 records, predict on 2 processes under skip: 7 rows over both files, no stand-in."""
    root = tmp_path / "data"
    broken = ["zero_byte", "html_error_page", "fifo", "zero_byte"]
    records = _split(root, "predict", 7, broken, first=500)
    out = tmp_path / "pred"
    args = [
        "predict", *_cli_config(tmp_path, "skip", predict=records), "--data.init_args.batch_size", "3",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
        *callback_args(tmp_path, EmbeddingWriter={"output_dir": str(out)}),
    ]  # fmt: skip
    result = _run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted(out.glob("embeddings_rank*.pt"))
    assert [f.name for f in files] == ["embeddings_rank0.pt", "embeddings_rank1.pt"]
    parts = [torch.load(f, weights_only=True) for f in files]
    index = torch.cat([p["index"] for p in parts])
    assert sorted(index.tolist()) == list(range(7)), index.tolist()  # the 7 valid items, once each
    assert sum(len(p["image_embeddings"]) for p in parts) == 7


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_cli_utf16_file_is_refused_once_in_every_mode(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "data"
    utf8 = _split(root, "train", 4, [])
    utf16 = root / "train16.jsonl"
    utf16.write_bytes(
        utf8.read_text().encode("utf-16")
    )  # with its byte-order mark, as Windows tools write it
    with pytest.raises(RecordError) as info:
        cli_main(["fit", *_cli_config(tmp_path / "a", mode, train=utf16), "--trainer.max_steps", "1"])
    message = str(info.value)
    assert message.startswith(f"{utf16}: the file is UTF-16") and "iconv -f UTF-16 -t UTF-8" in message
    # control: the same records in UTF-8 train
    cli = cli_main(["fit", *_cli_config(tmp_path / "b", mode, train=utf8), "--trainer.max_steps", "1"])
    assert cli.trainer.global_step == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            b'{"image": "images/good0.jpg", "text": "cut short"',
            "malformed JSON: Expecting ',' delimiter at the end of the line",
        ),
        (
            b'{"image": "images/good0.jpg" "text": "x"}',
            "malformed JSON: Expecting ',' delimiter at column 30",
        ),
        (b'{"text": "no image"}', "missing key 'image'"),
    ],
    ids=["truncated", "missing-comma", "no-image-key"],
)
def test_cli_json_errors_say_where_on_the_files_line(tmp_path: Path, line: bytes, expected: str) -> None:
    root = tmp_path / "data"
    train = write_case_file(root, [good_line(root, 0), line, good_line(root, 1)], "train.jsonl")
    with pytest.raises(RecordError) as info:
        cli_main(["fit", *_cli_config(tmp_path, "raise", train=train), "--trainer.max_steps", "1"])
    message = str(info.value)
    assert message == f"{train}:2: {expected}" or message.startswith(f"{train}:2: {expected} "), message
    assert "line 2 column" not in message and "(image ''" not in message
