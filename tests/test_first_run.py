"""What a new user meets first: the README's data commands on any config, offline failures in one line each, a
warning for more CPU processes than cores."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from urllib.error import URLError

import pytest
import torchvision
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer

from mm_lightning.assets import PretrainedUnavailable
from mm_lightning.callbacks.throughput import warn_if_processes_share_cores
from mm_lightning.cli import main
from mm_lightning.errors import cli_message
from mm_lightning.models.towers.torchvision import TorchvisionTower
from tests.conftest import DEMO_CONFIG, tiny_demo_args


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo's generated JSONL files and images."""
    root = tmp_path_factory.mktemp("first_run")
    assert main(["audit", *tiny_demo_args(root), "--audit.output", str(root / "report.json")]) == 0
    return root / "demo"


def jsonl_args(demo: Path, **files: str) -> list[str]:
    """The demo config reading the generated demo files as a user's JSONL data, with ``files`` replaced."""
    init_args = {
        "train_file": str(demo / "train.jsonl"),
        "val_file": str(demo / "val.jsonl"),
        "test_file": str(demo / "test.jsonl"),
        "batch_size": 16,
        **files,
    }
    data = {"class_path": "mm_lightning.data.MultimodalDataModule", "init_args": init_args}
    return [
        "--config", str(DEMO_CONFIG), "--data", json.dumps(data), "--model.image_tower.init_args.image_size", "32"
    ]  # fmt: skip


def test_audit_without_options_writes_its_report(
    demo_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the report's default place is the working directory
    assert main(["audit", *tiny_demo_args(demo_files.parent), "--audit.progress", "false"]) == 0
    report = json.loads((tmp_path / "audit_report.json").read_text())
    assert set(report["splits"]) == {"train", "val", "test"} and report["error_rate"] == 0


@pytest.mark.parametrize("command", ["audit", "shard"])
def test_a_recipes_test_file_that_does_not_exist_is_left_out_saying_so(
    demo_files: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "no" / "test.jsonl"
    args = jsonl_args(demo_files, test_file=str(missing))
    extra = (
        ["--audit.output", str(tmp_path / "r.json")] if command == "audit" else ["--out", str(tmp_path / "s")]
    )
    assert main([command, *args, *extra]) == 0
    out = capsys.readouterr().out
    assert f"{command}: test: {missing} does not exist: left out (--data.init_args.test_file sets it)" in out
    done = (
        json.loads((tmp_path / "r.json").read_text())["splits"]
        if command == "audit"
        else os.listdir(tmp_path / "s")
    )
    assert set(done) == {"train", "val"}


def test_a_missing_training_file_is_one_line(
    demo_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "train.jsonl"
    args = jsonl_args(demo_files, train_file=str(missing))
    assert main(["audit", *args, "--audit.output", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: MissingTrainingFile: audit: train: {missing} does not exist.")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("tower", "name", "expected"),
    [
        ("TorchvisionTower", "resnt50", "close names: resnet50"),
        ("TimmTower", "efficientnet_lite", "close names: efficientnet_lite"),
        ("TorchvisionTower", "no_such_net", r"the \d+ it has: torchvision.models.list_models\(\)"),
    ],
)
def test_an_unknown_model_name_is_one_line_naming_close_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture, tower: str, name: str, expected: str
) -> None:
    args = [
        "fit", *tiny_demo_args(tmp_path),
        "--model.image_tower", f"mm_lightning.models.towers.{tower}", "--model.image_tower.init_args.name", name,
    ]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert re.match(rf"error: UnknownModelError: {tower}: no model named '{name}'; {expected}", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("tower", "expected"),
    [
        (["--model.image_tower.init_args.name", "resnet18"], "TorchvisionTower 'resnet18'"),
        # another class: jsonargparse keeps the init_args it also takes, the demo's kwargs among them
        (["--model.image_tower", "TimmTower", "--model.image_tower.init_args.name", "efficientnet_lite0"],
         "TimmTower 'efficientnet_lite0'"),
    ],
)  # fmt: skip
def test_another_image_model_on_the_demo_config_names_the_options_it_does_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture, tower: list[str], expected: str
) -> None:
    args = ["fit", *tiny_demo_args(tmp_path, max_steps=1), *tower]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: TowerOptionsError: {expected} does not take kwargs ['layers', 'stem_stride', 'widths']"
    )
    assert "--model.image_tower.init_args.kwargs null" in err and "Traceback" not in err
    # control: the fix it names runs
    assert (
        main([*args, "--model.image_tower.init_args.kwargs", "null", "--trainer.limit_val_batches", "1"]) == 0
    )


def test_a_missing_model_folder_and_a_batch_size_of_0_are_one_error_each(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "my_models" / "bert"
    assert main(["fit", *tiny_demo_args(tmp_path), "--model.text_tower.init_args.name", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: MissingModelFolder: text tower '{missing}': no such local directory")
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:  # a parser error: the option and the rule, no traceback
        main(["fit", *tiny_demo_args(tmp_path), "--data.init_args.batch_size", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "batch_size" in err.split("error:", 1)[1] and "v>0" in err
    assert err.startswith("usage: ") and len(err.splitlines()) < 20  # not every option's usage first
    assert "Traceback" not in err


def test_torchvision_weights_without_internet_say_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(torchvision.models, "get_model", offline)
    with pytest.raises(
        PretrainedUnavailable,
        match="'resnet50': weights 'IMAGENET1K_V2'.*--model.image_tower.init_args.weights null",
    ):
        TorchvisionTower("resnet50", weights="IMAGENET1K_V2")
    message = cli_message(PretrainedUnavailable("x"))
    assert message is not None and message.startswith("error: PretrainedUnavailable: x")


def test_a_gpu_recipe_on_a_cpu_machine_says_what_to_pass() -> None:
    no_gpu = cli_message(MisconfigurationException("No supported gpu backend found!"))
    assert no_gpu is not None and "--trainer.accelerator cpu --trainer.devices 1" in no_gpu
    devices = cli_message(TypeError("`devices` selected with `CPUAccelerator` should be an int > 0."))
    assert devices is not None and "--trainer.devices 1" in devices
    # control: any other library error keeps its traceback
    assert cli_message(TypeError("unsupported operand type(s)")) is None
    assert cli_message(MisconfigurationException("something else")) is None


def test_more_cpu_processes_than_cores_warns() -> None:
    cores = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match=f"{cores + 1} processes on {cores} CPU cores"):
        warn_if_processes_share_cores(
            Trainer(accelerator="cpu", devices=cores + 1, strategy="ddp", logger=False)
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_processes_share_cores(Trainer(accelerator="cpu", devices=cores, strategy="ddp", logger=False))
    assert not [w for w in caught if "CPU cores" in str(w.message)]
