"""Evaluating a run: ``evaluate`` with a run's checkpoint scores under the data options the run trained with,
whatever config file is given, and its results say which options decided the protocol."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from mm_lightning.cli import cli_main, main
from mm_lightning.data.demo import TEMPLATES, generate_demo_dataset
from tests.conftest import DEMO_CONFIG, callback_args

CAPTIONS_PER_IMAGE = len(TEMPLATES)  # the demo writes one caption per template


def two_field_records(demo: Path, out: Path) -> dict[str, Path]:
    """The demo's splits as records with every caption under ``captions`` and the first again under ``text``
    (as Flickr-style files carry them)."""
    files = {}
    for split in ("train", "val", "test"):
        lines = []
        for line in (demo / f"{split}.jsonl").read_text().splitlines():
            record = json.loads(line)
            captions = record["text"]
            image = str(demo / record["image"])
            lines.append(json.dumps({"image": image, "captions": captions, "text": captions[0]}))
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("\n".join(lines) + "\n")
    return files


def data_args(files: dict[str, Path]) -> list[str]:
    return [
        "--data", "mm_lightning.data.MultimodalDataModule",
        "--data.init_args.train_file", str(files["train"]),
        "--data.init_args.val_file", str(files["val"]),
        "--data.init_args.test_file", str(files["test"]),
        "--data.init_args.batch_size", "16",
        "--data.init_args.max_length", "32",
        "--model.image_tower.init_args.image_size", "32",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def captions_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A few steps of the demo model trained with ``text_key: captions`` (its run folder, its files)."""
    root = tmp_path_factory.mktemp("captions_run")
    demo = generate_demo_dataset(root / "demo", image_size=32, train_renders=1, num_val=12, num_test=12)
    files = two_field_records(demo, root)
    run = root / "run"
    args = [
        "fit", "--config", str(DEMO_CONFIG), *data_args(files),
        "--data.init_args.text_key", "captions",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run), *callback_args(root),
    ]  # fmt: skip
    cli_main(args)
    return run, files


def evaluate(run: Path, files: dict[str, Path], out: Path, *extra: str) -> dict:
    """``evaluate`` with the recipe's config (which knows nothing of the run's options) and the run's folder."""
    return evaluated(
        out, "--config", str(DEMO_CONFIG), *data_args(files), "--trainer.default_root_dir", str(run),
        *callback_args(run.parent), "--ckpt_path", "last", *extra,
    )  # fmt: skip


def evaluated(out: Path, *args: str) -> dict:
    assert main(["evaluate", "--bootstrap_resamples", "0", "--output", str(out), *args]) == 0
    return read_result(out)


def read_result(out: Path) -> dict:
    (result,) = out.glob("*_zeroshot_retrieval.json")
    return json.loads(result.read_text())


def test_the_readme_command_scores_the_runs_captions_per_image(
    captions_run: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    run, files = captions_run
    result = evaluated(tmp_path, "--config", str(run / "version_0" / "config.yaml"), "--ckpt_path", "best")
    assert Path(result["pretrained"]).name.startswith("best")
    assert (result["images"], result["captions"]) == (12, 12 * CAPTIONS_PER_IMAGE)


def test_evaluate_scores_the_runs_captions_per_image(
    captions_run: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    run, files = captions_run
    result = evaluate(run, files, tmp_path / "carried")
    assert (result["images"], result["captions"]) == (12, 12 * CAPTIONS_PER_IMAGE)
    protocol = result["protocol"]
    assert protocol["data_options"]["text_key"] == "captions"
    assert protocol["captions_per_image"] == {"min": CAPTIONS_PER_IMAGE, "max": CAPTIONS_PER_IMAGE}
    assert protocol["from_run"] == {"text_key": {"config": "text", "run": "captions"}}
    assert protocol["differs_from_run"] == {}
    assert (
        "text_key: captions (the run's; the config says text)"
        in (tmp_path / "carried" / "results.md").read_text()
    )

    # control: the command line wins, and the results say it is not the run's protocol
    given = evaluate(run, files, tmp_path / "given", "--data.init_args.text_key", "text")
    assert (given["images"], given["captions"]) == (12, 12)
    assert given["protocol"]["differs_from_run"] == {"text_key": {"used": "text", "run": "captions"}}
    assert "differs from the run's" in (tmp_path / "given" / "results.md").read_text()


def with_missing_images(test_file: Path, out: Path, missing: int) -> Path:
    """``test_file`` with ``missing`` more records whose images do not exist."""
    lines = test_file.read_text().splitlines()
    for n in range(missing):
        lines.append(
            json.dumps({"image": str(out.parent / f"gone-{n}.png"), "captions": [f"gone {n}"], "text": "x"})
        )
    out.write_text("\n".join(lines) + "\n")
    return out


def test_results_say_which_test_records_were_skipped(
    captions_run: tuple[Path, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run, files = captions_run
    broken = with_missing_images(files["test"], tmp_path / "broken.jsonl", 1)
    skip = ["--data.init_args.test_file", str(broken), "--data.init_args.on_bad_record", "skip"]
    # control: while the image is there, the same file skips none
    first_image = json.loads(files["test"].read_text().splitlines()[0])["image"]
    shutil.copy(first_image, tmp_path / "gone-0.png")
    present = evaluate(run, files, tmp_path / "present", *skip, "--bootstrap_resamples", "20")
    assert present["images"] == 13 and present["skipped"] == {"count": 0, "by_kind": {}, "reasons_file": None}
    assert "test records skipped: none" in (tmp_path / "present" / "results.md").read_text()

    # the image gone: its record is skipped and said so; a comparison with the first evaluation is refused
    (tmp_path / "gone-0.png").unlink()
    args = ["--config", str(DEMO_CONFIG), *data_args(files), "--trainer.default_root_dir", str(run), *skip]
    args += [*callback_args(run.parent), "--ckpt_path", "last", "--output", str(tmp_path / "broken")]
    assert (
        main(["evaluate", *args, "--bootstrap_resamples", "20", "--compare_to", str(tmp_path / "present")])
        == 1
    )
    assert re.search(
        rf"skipped other test records \(1 here, 0 there; only here: .*{broken.name}:13",
        capsys.readouterr().err,
    )
    result = read_result(tmp_path / "broken")  # written all the same
    assert result["images"] == 12  # the broken record is left out of the figures
    assert result["skipped"] == {
        "count": 1,
        "by_kind": {"missing_image": 1},
        "reasons_file": "broken_skipped.txt",
    }
    table = (tmp_path / "broken" / "results.md").read_text()
    assert "**test records skipped: 1** (missing_image 1)" in table
    assert f"{broken}:13" in (tmp_path / "broken" / "broken_skipped.txt").read_text()


def test_skips_are_counted_without_any_callback(
    captions_run: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    run, files = captions_run
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["trainer"]["callbacks"] = []  # none at all, not even the defaults
    config["data"] = {
        "class_path": "mm_lightning.data.MultimodalDataModule",
        "init_args": {"on_bad_record": "skip"},
    }
    config_file = tmp_path / "own.yaml"
    config_file.write_text(yaml.safe_dump(config))

    def tested(test_file: Path) -> tuple[list[str], Any]:
        args = [
            "test", "--config", str(config_file), "--data.init_args.test_file", str(test_file),
            "--model.image_tower.init_args.image_size", "32", "--trainer.default_root_dir", str(tmp_path),
            "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
        ]  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli = cli_main(args)
        return [str(w.message) for w in caught if "bad records skipped" in str(w.message)], cli.datamodule

    broken = with_missing_images(files["test"], tmp_path / "broken.jsonl", 7)
    summaries, datamodule = tested(broken)
    assert len(summaries) == 1 and "7 bad records skipped (test 7; by kind: missing_image 7)" in summaries[0]
    assert datamodule.skipped.report("test")["count"] == 7
    # control: the records without the missing images
    summaries, datamodule = tested(files["test"])
    assert summaries == [] and datamodule.skipped.report("test")["count"] == 0
