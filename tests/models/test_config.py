"""Grouped model options: dataclasses or dicts from Python, nested groups and parts by class_path on the
command line, plain-dict hyperparameters in checkpoints (with each part's class_path + init_args when the CLI
built the module)."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

import pytest
import torch

from mm_lightning.models import DualEncoder, FusionConfig, MultimodalModule, OptimConfig
from mm_lightning.models.config import ObjectiveConfig, TowerTraining
from mm_lightning.models.towers import HFTextTower, TorchvisionTower
from mm_lightning.option_groups import as_config
from tests.models.helpers import (
    PARTS,
    make_batch,
    module_kwargs,
    save_checkpoint,
    tiny_config,
    tiny_module,
    tiny_parts,
)


def _class_of(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(import_module(module), name)


def _saved_hparams(model: MultimodalModule, path: Path) -> dict:
    save_checkpoint(model, path)
    return torch.load(path, weights_only=True)["hyper_parameters"]  # no pickled classes


def test_dataclasses_and_dicts_build_the_same_model() -> None:
    config = tiny_config(optim={"lr": 2e-3}, image={"project": True})
    from_dicts = MultimodalModule(**module_kwargs(config))
    typed = dict(
        module_kwargs(config),
        image=TowerTraining(**config["image"]),
        fusion=FusionConfig(**config["fusion"]),
        optim=OptimConfig(lr=2e-3),
    )
    from_dataclasses = MultimodalModule(**typed)
    # hparams hold each group as given (dict or dataclass): compare what the module made of them
    for name in ("image_config", "text_config", "objective_config", "optim_config"):
        assert getattr(from_dicts, name) == getattr(from_dataclasses, name), name
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (from_dicts, from_dataclasses)]
    assert shapes[0] == shapes[1]  # the same network (projections, fusion widths)
    heads = [
        [m.num_heads for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
        for model in (from_dicts, from_dataclasses)
    ]
    assert heads[0] == heads[1] and heads[0]  # the fusion's heads (shapes alone do not show them)
    assert (
        from_dicts.optim_config.lr == 2e-3 and from_dicts.optim_config.weight_decay == 0.05
    )  # defaults kept


def test_unknown_or_mistyped_options_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"ObjectiveConfig: unknown option\(s\) \['itm_wieght'\]"):
        as_config(ObjectiveConfig, {"itm_wieght": 0.5})
    with pytest.raises(TypeError, match="expected OptimConfig"):
        as_config(OptimConfig, 3e-3)


def test_checkpoint_stores_plain_dicts_and_reloads_with_the_parts_given(tmp_path: Path) -> None:
    model = tiny_module(objective={"itm_weight": 0.0}, text_tower={"pooling": "mean"})
    path = tmp_path / "model.ckpt"
    hparams = _saved_hparams(model, path)
    assert hparams["objective"]["itm_weight"] == 0.0
    assert all(hparams.get(name) is None for name in PARTS)  # built in Python: the parts are not recorded
    # the parts are given again (the same description: the mean-pooling text tower)
    reloaded = MultimodalModule.load_from_checkpoint(
        path, map_location="cpu", **tiny_parts(text_tower={"pooling": "mean"})
    )
    assert reloaded.objective_config == model.objective_config and reloaded.model.itm is None
    model.eval(), reloaded.eval()
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(batch), reloaded(batch))


def test_a_cli_checkpoint_records_the_parts_and_reloads_alone(tmp_path: Path) -> None:
    from mm_lightning.cli import cli_main
    from tests.conftest import tiny_demo_args

    cli = cli_main([*tiny_demo_args(tmp_path), "--model.objective.itm_weight", "0"], run=False)
    model = cli.model
    path = tmp_path / "model.ckpt"
    hparams = _saved_hparams(model, path)
    # the class_path as the CLI writes it (its shortest import path)
    assert _class_of(hparams["image_tower"]["class_path"]) is TorchvisionTower
    assert hparams["image_tower"]["init_args"]["image_size"] == 32
    assert _class_of(hparams["text_tower"]["class_path"]) is HFTextTower
    assert hparams["text_tower"]["init_args"]["name"] == "mm-lightning/demo-bert"
    assert hparams["objective"]["itm_weight"] == 0.0
    reloaded = MultimodalModule.load_from_checkpoint(path, map_location="cpu")  # nothing else given
    network = DualEncoder.from_checkpoint(path)
    assert (
        reloaded.objective_config == model.objective_config
        and reloaded.model.itm is None
        and network.itm is None
    )
    model.eval(), reloaded.eval(), network.eval()
    batch = make_batch()
    with torch.no_grad():
        want = model(batch)
        torch.testing.assert_close(reloaded(batch), want)
        torch.testing.assert_close(network(batch), want)


def test_nested_groups_and_tower_arguments_on_the_command_line(tmp_path: Path) -> None:
    from mm_lightning.cli import cli_main
    from tests.conftest import tiny_demo_args

    args = [
        *tiny_demo_args(tmp_path),
        "--model.image_tower.init_args.name", "vit_custom",
        "--model.image_tower.init_args.kwargs",
        '{"patch_size": 8, "num_layers": 1, "hidden_dim": 32, "num_heads": 2, "mlp_dim": 32}',
        "--model.optim.lr", "3e-4",
        "--model.term_weighting", "mm_lightning.extras.DynamicWeightAveraging",
        "--model.term_weighting.window", "7",
    ]  # fmt: skip
    cli = cli_main(args, run=False)
    model = cli.model
    backbone = model.model.image_encoder.backbone
    assert type(backbone).__name__ == "VisionTransformer" and backbone.hidden_dim == 32  # vit_custom + kwargs
    assert model.data_config["image"]["input_size"][-1] == 32  # image_size from tiny_demo_args
    assert model.optim_config.lr == 3e-4 and model.optim_config.warmup_steps == 50  # the rest from demo.yaml
    assert (
        type(model.objective.term_weighting).__name__ == "DynamicWeightAveraging"
        and model.objective.term_weighting.window == 7
    )
    assert backbone.image_size == 32
    assert cli.datamodule.hparams.tokenizer == model.model.data_config["text"]["tokenizer"]


def test_module_reports_the_towers_preprocessing() -> None:
    config = tiny_module().data_config
    assert config["image"]["input_size"] == (3, 32, 32) and config["image"]["interpolation"] == "bilinear"
    assert config["text"] == {"tokenizer": "mm-lightning/demo-bert"}
