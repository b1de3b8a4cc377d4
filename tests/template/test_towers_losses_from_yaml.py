"""Make it yours: a user's image tower, text tower and loss named in YAML, their files outside the package, trained
through the CLI; the checkpoint validates through the CLI again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests import preloaded
from tests.conftest import REPO, tiny_demo_args

EXAMPLE = REPO / "examples" / "make_it_yours"  # what the README shows


def run_cli(args: list[str], user: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{user}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return preloaded.run(
        [sys.executable, "-m", "mm_lightning", *args], capture_output=True, timeout=240, env=env
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_user_towers_and_loss_from_yaml_train_and_validate_from_their_checkpoint(tmp_path: Path) -> None:
    user = tmp_path / "user_code"  # outside the package, on PYTHONPATH as a user's project would be
    user.mkdir()
    for name in ("my_towers.py", "my_losses.py", "my_model.yaml"):
        shutil.copy(EXAMPLE / name, user)
    args = tiny_demo_args(tmp_path / "run", max_steps=4)
    # the user's config between the demo's and the tiny overrides (the user's image tower takes their image_size)
    args = [*args[:2], "--config", str(user / "my_model.yaml"), *args[2:]]
    fit = run_cli(["fit", *args], user)
    assert fit.returncode == 0, fit.stderr[-3000:]
    summary = fit.stdout + fit.stderr  # the model summary's layer table
    assert "PatchMLP" in summary and "MeanOfWords" in summary and "HardestNegativeHinge" in summary
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss_itc", "train/loss_spread", "train/loss_itm", "val/loss", "val/r1_t2i"} <= tags
    assert "train/temperature" not in tags  # the user's loss has none
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    # the class_path + init_args the CLI built each part from (Lightning's own recording)
    assert hparams["image_tower"] == {
        "class_path": "my_towers.PatchMLP",
        "init_args": {"width": 128, "patch": 8, "image_size": 32},  # the image size from the command line
    }
    assert hparams["text_tower"]["class_path"] == "my_towers.MeanOfWords"
    assert hparams["loss"]["class_path"] == "my_losses.HardestNegativeHinge"
    assert any(k.startswith("model.image_encoder.embed.") for k in checkpoint["state_dict"])
    validate = run_cli(
        ["validate", "--config", str(tmp_path / "run" / "version_0" / "config.yaml"),
         "--ckpt_path", str(tmp_path / "run" / "checkpoints" / "last.ckpt")],
        user,
    )  # fmt: skip
    assert validate.returncode == 0, validate.stderr[-3000:]
    assert "val/r1_t2i" in validate.stdout + validate.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tower_breaking_the_contract_is_one_clear_cli_error(tmp_path: Path) -> None:
    user = tmp_path / "user_code"
    user.mkdir()
    (user / "bad_towers.py").write_text(
        "from torch import nn\n\n\nclass FeatureMap(nn.Conv2d):\n"
        "    def __init__(self, image_size: int = 32) -> None:\n        super().__init__(3, 8, 4, stride=4)\n"
        "        self.image_size = image_size\n"
    )
    result = run_cli(
        ["fit", *tiny_demo_args(tmp_path / "run"), "--model.image_tower", "bad_towers.FeatureMap"], user
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert (
        "error: TowerContractError: image tower bad_towers.FeatureMap: it returned a tensor of shape (2, 8, 8, 8)"
        in result.stderr
    )
