"""Every shipped config parses (alone or as an overlay) and says in its header what it is for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from mm_lightning.cli import cli_main
from mm_lightning.config_parser import CheckedParser
from tests.conftest import CHECKPOINT_GROUPS, DEFAULT_CALLBACKS, callback_args

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# configs without a model of their own (the towers have no defaults), parsed on top of a recipe: base.yaml unless
# OVERLAY_ON names another (the recipe their header shows them with)
OVERLAYS = {
    "ddp.yaml",
    "ddp_explicit.yaml",
    "fsdp2.yaml",
    "modality_parallel.yaml",
    "demo_data.yaml",
    "shards.yaml",
    "loggers.yaml",
}
OVERLAY_ON = {"shards.yaml": "demo.yaml", "modality_parallel.yaml": "demo.yaml"}


def _print_config(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {"demo.yaml", "base.yaml"} | OVERLAYS


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_config_parses_and_has_header(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = (CONFIGS / name).read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert text.startswith("#") and any("python -m mm_lightning" in line for line in header), name
    stack = ["--config", str(CONFIGS / OVERLAY_ON.get(name, "base.yaml"))] if name in OVERLAYS else []
    config = _print_config(capsys, *stack, "--config", str(CONFIGS / name))
    # a linked target (data.tokenizer) is derived, so --print_config leaves it out; the image size flows from the
    # image tower to the data when the CLI builds them (no config sets data.images.size)
    assert (
        "tokenizer" not in config["data"]["init_args"]
        and (config["data"]["init_args"]["images"] or {}).get("size") is None
    )
    assert "image_size" in config["model"]["image_tower"]["init_args"]
    if name == "ddp_explicit.yaml":
        assert (
            config["trainer"]["strategy"]["class_path"] == "mm_lightning.extras.ExplicitAllReduceDDPStrategy"
        )
        assert config["trainer"]["precision"] == "bf16-mixed"  # the base recipe is kept under the overlay


def dotted_keys(node: object, prefix: str = "") -> set[str]:
    """Every key of a nested mapping, dotted (``model.fusion.heads``)."""
    if not isinstance(node, dict):
        return set()
    keys = set()
    for key, value in node.items():
        keys |= {f"{prefix}{key}"} | dotted_keys(value, f"{prefix}{key}.")
    return keys


def test_the_demo_config_holds_no_switch_of_an_opt_in_part(capsys: pytest.CaptureFixture[str]) -> None:
    config = _print_config(capsys, "--config", str(CONFIGS / "demo.yaml"))
    keys = dotted_keys(config)
    switches = {
        "model.image.layer_decay", "model.text.layer_decay", "model.image.adapter", "model.text.adapter",
        "model.grad_cache", "model.objective.weighting", "model.objective.dwa_window",
        "model.objective.dwa_temperature", "model.objective.sample_weighting", "model.fusion.rerank_k",
        "data.init_args.loader.length_grouping", "data.init_args.loader.length_window",
    }  # fmt: skip
    assert switches.isdisjoint(keys), sorted(switches & keys)
    # the parts' slots are there, empty (the core's defaults); the core's own knobs too (control: keys are read)
    slots = ["model.param_groups", "model.batch_embedding", "model.term_weighting", "model.sample_weighting",
             "model.adapters", "model.reranker", "data.init_args.train_order"]  # fmt: skip
    assert all(key in keys for key in slots) and config["model"]["adapters"] is None
    assert {"model.fusion.heads", "model.optim.lr_scaling", "data.init_args.loader.caption_sampling"} <= keys


def test_base_recipe_is_resnet50_and_bert(capsys: pytest.CaptureFixture[str]) -> None:
    config = _print_config(capsys, "--config", str(CONFIGS / "base.yaml"))
    image, text = config["model"]["image_tower"]["init_args"], config["model"]["text_tower"]["init_args"]
    assert image["name"] == "resnet50"
    assert text["name"] == "bert-base-uncased"
    data = config["data"]["init_args"]
    assert image["image_size"] == 224 and (data["images"] or {}).get("size") is None
    assert (data["max_length"], data["batch_size"]) == (128, 32)
    assert data["loader"]["pin_memory"] is True and 4 <= data["num_workers"] <= 8
    assert config["trainer"]["strategy"] == "ddp"


def test_a_recipe_names_its_parts_by_class_path(capsys: pytest.CaptureFixture[str]) -> None:
    config = _print_config(capsys, "--config", str(CONFIGS / "lit.yaml"))
    model = config["model"]
    for part, name in (
        ("image_tower", "TimmTower"),
        ("text_tower", "HFTextTower"),
        ("loss", "ContrastiveLoss"),
    ):
        class_path = model[part]["class_path"]
        assert class_path.startswith("mm_lightning.") and class_path.endswith(f".{name}"), (part, class_path)


def test_a_tower_class_by_its_short_name(capsys: pytest.CaptureFixture[str]) -> None:
    # LightningCLI resolves a class's short name; an init arg of the new class is set beside it
    config = _print_config(
        capsys,
        "--config",
        str(CONFIGS / "demo.yaml"),
        "--model.image_tower",
        "TimmTower",
        "--model.image_tower.init_args.name",
        "resnet10t",
    )
    tower = config["model"]["image_tower"]
    assert tower["class_path"].startswith("mm_lightning.") and tower["class_path"].endswith("TimmTower")
    assert tower["init_args"]["name"] == "resnet10t"
    # control: the recipe's own tower is another class
    demo = _print_config(capsys, "--config", str(CONFIGS / "demo.yaml"))
    assert not demo["model"]["image_tower"]["class_path"].endswith("TimmTower")


def test_strategy_shorthand_and_nested_override(capsys: pytest.CaptureFixture[str]) -> None:
    demo = str(CONFIGS / "demo.yaml")
    config = _print_config(capsys, "--config", demo, "--trainer.strategy", "ddp_explicit")
    assert config["trainer"]["strategy"] == "ddp_explicit"
    overlay = str(CONFIGS / "ddp_explicit.yaml")
    config = _print_config(
        capsys, "--config", demo, "--config", overlay, "--trainer.strategy.mode", "per_parameter"
    )
    assert config["trainer"]["strategy"]["init_args"]["mode"] == "per_parameter"
    # nested options need the class (a registry name is a plain string)
    config = _print_config(
        capsys,
        "--config",
        demo,
        "--trainer.strategy",
        "mm_lightning.extras.ExplicitAllReduceDDPStrategy",
        "--trainer.strategy.mode",
        "per_parameter",
    )
    assert config["trainer"]["strategy"]["class_path"] == "mm_lightning.extras.ExplicitAllReduceDDPStrategy"
    assert config["trainer"]["strategy"]["init_args"]["mode"] == "per_parameter"


def test_nested_options_under_a_strategy_name_say_how_to_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # a registry name is a plain string, in a config file or on the command line: the error says what to write
    named = tmp_path / "named.yaml"
    named.write_text("trainer:\n  strategy: ddp_explicit\n")
    args = ["--config", str(CONFIGS / "demo.yaml"), "--config", str(named)]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *args, "--trainer.strategy.mode", "per_parameter", "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "class_path: mm_lightning.extras.ExplicitAllReduceDDPStrategy" in err
        and "configs/ddp_explicit.yaml" in err
    )


def test_run_dir_moves_logs_and_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    config = _print_config(
        capsys, "--config", str(CONFIGS / "demo.yaml"), "--trainer.default_root_dir", "runs/a"
    )
    assert config["trainer"]["default_root_dir"] == "runs/a"
    # derived from the run directory after parsing, unless set (tests below), so printed as unset
    # best, last.ckpt at epoch ends, last.ckpt every 30 minutes
    assert all(config[group]["dirpath"] is None for group in CHECKPOINT_GROUPS)
    assert "save_dir" not in config["trainer"]["logger"]["init_args"]
    assert config["trainer"]["plugins"][0]["class_path"] == "mm_lightning.checkpoints.AtomicCheckpointIO"


def _checkpoint_dir(*args: str) -> str:
    cli = cli_main(
        ["--config", str(CONFIGS / "demo.yaml"), "--trainer.default_root_dir", "runs/a", *args], run=False
    )
    best, last, timed = cli.trainer.checkpoint_callbacks  # best first: last.ckpt then records its fresh state
    assert (last.monitor, best.monitor) == (None, "val/r1_t2i")
    assert best.dirpath == last.dirpath == timed.dirpath
    return os.path.relpath(last.dirpath)


def test_checkpoint_dirpath_is_honoured_from_the_command_line(tmp_path: Path) -> None:
    assert _checkpoint_dir() == os.path.join("runs", "a", "checkpoints")  # the default: under the run dir
    moved = callback_args(tmp_path, checkpoint={"dirpath": "elsewhere/yaml"})
    assert _checkpoint_dir(*moved) == os.path.join("elsewhere", "yaml")  # the best one follows last.ckpt's


def test_checkpoint_options_are_set_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    cli = cli_main(
        ["--config", str(CONFIGS / "demo.yaml"), "--checkpoint.every_n_train_steps", "7",
         "--timed_checkpoint.train_time_interval", "01:00:00", "--best_checkpoint.monitor", "val/loss",
         "--best_checkpoint.mode", "min"],
        run=False,
    )  # fmt: skip
    best, last, timed = cli.trainer.checkpoint_callbacks
    # the trigger, as its state key records it
    assert last.filename == "last" and "'every_n_train_steps': 7" in last.state_key
    assert "'train_time_interval': datetime.timedelta(seconds=3600)" in timed.state_key
    assert (best.monitor, best.mode) == ("val/loss", "min")
    printed = _print_config(
        capsys, "--config", str(CONFIGS / "demo.yaml"), "--checkpoint.every_n_train_steps", "7"
    )
    assert printed["checkpoint"]["every_n_train_steps"] == 7
    assert printed["timed_checkpoint"]["train_time_interval"] == "0:30:00"  # control: the default


def test_short_names_of_built_in_classes_resolve_by_jsonargparse(capsys: pytest.CaptureFixture[str]) -> None:
    printed = _print_config(
        capsys, "--config", str(CONFIGS / "demo.yaml"), "--model.image_tower", "TimmTower",
        "--model.image_tower.init_args.name", "resnet18", "--model.loss=ContrastiveLoss",
        "--model.loss.init_args.temperature_init=0.05",
        "--trainer.callbacks+=BadRecordLogger", "--data.init_args.text_key=Record",
    )  # fmt: skip
    assert printed["model"]["image_tower"]["class_path"].endswith(".TimmTower")
    assert printed["model"]["loss"]["class_path"].endswith(".ContrastiveLoss")
    assert printed["model"]["loss"]["init_args"]["temperature_init"] == 0.05
    assert printed["trainer"]["callbacks"][-1]["class_path"] == "mm_lightning.callbacks.BadRecordLogger"
    # control: an option that takes a plain value keeps a value that happens to be a class's name
    assert printed["data"]["init_args"]["text_key"] == "Record"


def test_a_short_name_the_parser_cannot_resolve_gets_its_path(capsys: pytest.CaptureFixture[str]) -> None:
    # the short name of a built-in class jsonargparse did not resolve (an extra not loaded yet, say): its error, plus
    # the path
    parser = CheckedParser(exit_on_error=True)
    with pytest.raises(SystemExit):
        parser.error('Parser key "model.loss": Expected a dot import path string: SigLipLoss')
    assert "Name the class by its path: mm_lightning.models.losses.SigLipLoss" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an extra, whose package a run loads only when it names one
        parser.error('Parser key "trainer.callbacks": Expected a dot import path string: NaNGuard')
    assert "Name the class by its path: mm_lightning.extras.NaNGuard" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.error('Parser key "model.loss": Expected a dot import path string: MyLoss')  # control
    assert "Name the class by its path" not in capsys.readouterr().err


def test_saved_configs_name_callbacks_by_their_package(capsys: pytest.CaptureFixture[str]) -> None:
    long_run = str(CONFIGS / "callbacks" / "long_run.yaml")
    config = _print_config(capsys, "--config", str(CONFIGS / "demo.yaml"), "--trainer.callbacks+", long_run)
    names = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert "mm_lightning.extras.NaNGuard" in names and "mm_lightning.callbacks.RunSummary" in names


# what Lightning adds itself: the CLI's config writer and the progress bar of trainer.enable_progress_bar
ADDED_BY_LIGHTNING = {"SaveConfigCallback", "TQDMProgressBar", "RichProgressBar"}


def _not_in_config(callbacks: list, printed: dict) -> list[str]:
    listed = [c["class_path"] if isinstance(c, dict) else c for c in printed["trainer"]["callbacks"]]
    listed += ["lightning.pytorch.callbacks.ModelCheckpoint"] * len(set(CHECKPOINT_GROUPS) & printed.keys())
    left = [f"{type(c).__module__}.{type(c).__qualname__}" for c in callbacks]
    for path in listed:  # each listed class accounts for one callback of the run
        cls = type(next(c for c in callbacks if path.endswith("." + type(c).__qualname__)))
        left.remove(f"{cls.__module__}.{cls.__qualname__}")
    return [name for name in left if name.rpartition(".")[2] not in ADDED_BY_LIGHTNING]


def test_every_callback_of_a_demo_run_is_in_its_printed_config(capsys: pytest.CaptureFixture[str]) -> None:
    printed = _print_config(capsys, "--config", str(CONFIGS / "demo.yaml"))
    trainer = cli_main(["--config", str(CONFIGS / "demo.yaml")], run=False).trainer
    assert _not_in_config(trainer.callbacks, printed) == []
    assert len(printed["trainer"]["callbacks"]) == 7
    # control: a callback the config does not name is found
    from lightning.pytorch.callbacks import EarlyStopping

    extra = [*trainer.callbacks, EarlyStopping(monitor="val/loss")]
    assert _not_in_config(extra, printed) == ["lightning.pytorch.callbacks.early_stopping.EarlyStopping"]


@pytest.mark.parametrize(("name", "extras"), [("locked_features.yaml", 1), ("monitored.yaml", 5)])
def test_callback_files_are_their_extras_then_a_long_runs(name: str, extras: int) -> None:
    long_run = yaml.safe_load((CONFIGS / "callbacks" / "long_run.yaml").read_text())
    assert yaml.safe_load((CONFIGS / "callbacks" / name).read_text())[extras:] == long_run
    assert [entry["class_path"] for entry in long_run] == [
        "mm_lightning.extras.NaNGuard",
        "mm_lightning.extras.PreemptionCheckpoint",
        "mm_lightning.extras.ExactResume",
    ]


@pytest.mark.parametrize(
    ("recipe", "added"),
    [("demo.yaml", None), ("finetune.yaml", "long_run.yaml"), ("lit.yaml", "locked_features.yaml"),
     ("base.yaml", "monitored.yaml")],
)  # fmt: skip
def test_recipes_add_their_callbacks_to_the_one_default_list(
    capsys: pytest.CaptureFixture[str], recipe: str, added: str | None
) -> None:
    printed = _print_config(capsys, "--config", str(CONFIGS / recipe))["trainer"]["callbacks"]
    default = yaml.safe_load(DEFAULT_CALLBACKS.read_text())
    extra = yaml.safe_load((CONFIGS / "callbacks" / added).read_text()) if added else []
    names = [entry["class_path"] for entry in printed]
    assert names == [entry["class_path"] for entry in default + extra]
    assert "lightning.pytorch.callbacks.ModelCheckpoint" not in names  # the checkpoints are option groups


def test_a_monitor_on_the_last_checkpoint_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monitored = callback_args(tmp_path, checkpoint={"monitor": "val/loss"})
    with pytest.raises(SystemExit):
        cli_main(["--config", str(CONFIGS / "demo.yaml"), *monitored], run=False)
    assert "set the monitor on best_checkpoint (--best_checkpoint.monitor)" in capsys.readouterr().err
    cli_main(["--config", str(CONFIGS / "demo.yaml"), *callback_args(tmp_path)], run=False)  # control


def test_checkpointing_off_says_how(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--config", str(CONFIGS / "demo.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        cli_main([*args, "--trainer.enable_checkpointing", "false"], run=False)
    fix = " ".join(f"--{group}.save_top_k 0" for group in CHECKPOINT_GROUPS)
    assert fix in capsys.readouterr().err
    cli = cli_main([*args, *fix.split()], run=False)  # control: the fix it names
    assert all(c.save_top_k == 0 for c in cli.trainer.checkpoint_callbacks)


def test_a_listed_checkpoint_doing_a_groups_work_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A callbacks file copied before the checkpoints became option groups lists last.ckpt's ModelCheckpoint."""
    last = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"filename": "last", "every_n_train_steps": 500}}  # fmt: skip
    args = ["--config", str(CONFIGS / "demo.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        cli_main([*args, "--trainer.callbacks", json.dumps([last])], run=False)
    assert "does the work of the checkpoint option group" in capsys.readouterr().err
    # controls: with that group off it is the run's last.ckpt; a checkpoint of its own (every step's) joins them
    cli_main([*args, "--trainer.callbacks", json.dumps([last]), "--checkpoint.save_top_k", "0",
              "--timed_checkpoint.save_top_k", "0"], run=False)  # fmt: skip
    steps = {**last, "init_args": {"filename": "{step}", "every_n_train_steps": 1, "save_top_k": -1}}
    cli = cli_main([*args, "--trainer.callbacks", json.dumps([steps])], run=False)
    assert len(cli.trainer.checkpoint_callbacks) == 4


def test_ckpt_path_last_without_checkpoint_callbacks_says_what_to_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["validate", "--config", str(CONFIGS / "demo.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        off = [f"--{group}.save_top_k=0" for group in CHECKPOINT_GROUPS]
        cli_main([*args, *off, "--ckpt_path", "last"])
    assert "has no checkpoint callback" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # control: with them, the usual line naming the folder it looked in
        cli_main([*args, "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert "has no checkpoint callback" not in err and str(tmp_path / "checkpoints") in err
