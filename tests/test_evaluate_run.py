"""Evaluating a run: ``evaluate`` with a run's checkpoint scores under the data options the run trained with,
whatever config file is given, and its results say which options decided the protocol."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert main(["evaluate", *args, "--output", str(out), "--bootstrap_resamples", "0"]) == 0
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
