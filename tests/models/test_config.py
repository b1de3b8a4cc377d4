"""Grouped model options: dataclasses or dicts from Python, nested groups on the command line, plain-dict
hyperparameters in checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from mm_lightning.models import ImageTowerConfig, MultimodalModule, OptimConfig
from mm_lightning.models.config import LossConfig, as_config
from tests.models.helpers import make_batch, tiny_config, tiny_module


def test_dataclasses_and_dicts_build_the_same_model() -> None:
    config = tiny_config(optim={"lr": 2e-3})
    from_dicts = MultimodalModule(**config)
    typed = dict(config, image=ImageTowerConfig(**config["image"]), optim=OptimConfig(lr=2e-3))
    from_dataclasses = MultimodalModule(**typed)
    assert from_dicts.hparams == from_dataclasses.hparams
    assert (
        from_dicts.optim_config.lr == 2e-3 and from_dicts.optim_config.weight_decay == 0.05
    )  # defaults kept


def test_unknown_or_mistyped_options_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"LossConfig: unknown option\(s\) \['itm_wieght'\]"):
        as_config(LossConfig, {"itm_wieght": 0.5})
    with pytest.raises(TypeError, match="expected OptimConfig"):
        as_config(OptimConfig, 3e-3)


def test_checkpoint_stores_plain_dicts_and_reloads(tmp_path: Path) -> None:
    model = tiny_module(loss={"itm_weight": 0.0}, text={"pooling": "mean"})
    path = tmp_path / "model.ckpt"
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    hparams = torch.load(path, weights_only=True)["hyper_parameters"]  # no pickled classes
    assert hparams["loss"]["itm_weight"] == 0.0 and hparams["text"]["pooling"] == "mean"
    reloaded = MultimodalModule.load_from_checkpoint(path, map_location="cpu")
    assert reloaded.loss_config == model.loss_config and reloaded.model.itm is None
    model.eval(), reloaded.eval()
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(batch), reloaded(batch))


def test_nested_groups_on_the_command_line(tmp_path: Path) -> None:
    from mm_lightning.cli import cli_main
    from tests.conftest import tiny_demo_args

    args = [
        *tiny_demo_args(tmp_path),
        "--model.image.name", "vit_custom",
        "--model.image.kwargs", '{"patch_size": 8, "num_layers": 1, "hidden_dim": 32, "num_heads": 2, "mlp_dim": 32}',
        "--model.optim.lr", "3e-4",
        "--model.loss.weighting", "dwa",
    ]  # fmt: skip
    cli = cli_main(args, run=False)
    model = cli.model
    assert model.image_config.name == "vit_custom" and model.image_config.image_size == 32  # linked from data
    assert model.optim_config.lr == 3e-4 and model.optim_config.warmup_steps == 50  # the rest from demo.yaml
    assert model.dwa is not None and model.model.image_encoder.backbone.image_size == 32
    assert cli.datamodule.hparams.tokenizer == model.text_config.name


def test_module_reports_the_towers_preprocessing() -> None:
    config = tiny_module().data_config
    assert config["image"]["input_size"] == (3, 32, 32) and config["image"]["interpolation"] == "bilinear"
    assert config["text"] == {"tokenizer": "mm-lightning/demo-bert"}
