"""Checkpoints are data: a checkpoint that ``torch.load(weights_only=True)`` accepts (plain dicts, strings, lists)
but names a class or function that is not of its slot's kind is refused by every loader, in one line, before
anything it names is called; the same checkpoint with its legitimate parts loads."""

from __future__ import annotations

import hashlib
import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.cli import instantiate_class
from lightning.pytorch.core.saving import save_hparams_to_yaml
from PIL import Image

from mm_lightning.checkpoints.files import CheckpointFileError, sha256_of
from mm_lightning.checkpoints.loading import UnsafeCheckpointError
from mm_lightning.cli import cli_main, main
from mm_lightning.models import DualEncoder, MultimodalModule
from tests.conftest import TinyRun, tiny_demo_args
from tests.models.helpers import make_batch, save_checkpoint
from tests.template import user_parts

# A class whose construction writes a file: it stands for any command (logging.FileHandler opens its file at once).
MARKER_CLASS = "logging.FileHandler"
MARKER_FUNCTION = "tests.resilience.hostile_payload.leave_marker"


def marker_part(marker: Path) -> dict[str, Any]:
    return {"class_path": MARKER_CLASS, "init_args": {"filename": str(marker)}}


def _set_image_tower(hparams: dict[str, Any], marker: Path) -> None:
    hparams["image_tower"] = marker_part(marker)


def _set_text_tower(hparams: dict[str, Any], marker: Path) -> None:
    hparams["text_tower"] = marker_part(marker)


def _set_loss(hparams: dict[str, Any], marker: Path) -> None:
    hparams["loss"] = marker_part(marker)


def _set_rule(hparams: dict[str, Any], marker: Path) -> None:
    # a training rule's slot takes its base class only (here a module that is no ParamGroupRule)
    hparams["param_groups"] = marker_part(marker)


def _set_option_group(hparams: dict[str, Any], marker: Path) -> None:
    hparams["fusion"] = marker_part(marker)


def _set_tower_option(hparams: dict[str, Any], marker: Path) -> None:
    # a plain dict option of the tower (TorchvisionTower's backbone kwargs): no class may hide in it
    hparams["image_tower"]["init_args"]["kwargs"]["norm_layer"] = marker_part(marker)


def _set_instantiator(hparams: dict[str, Any], marker: Path) -> None:
    hparams["_instantiator"] = MARKER_FUNCTION


def _set_part_as_text(hparams: dict[str, Any], marker: Path) -> None:
    # jsonargparse reads a string as YAML: the record inside it must not escape the check
    hparams["image_tower"] = json.dumps(marker_part(marker))


def _set_part_without_class_path(hparams: dict[str, Any], marker: Path) -> None:
    # LightningCLI would merge it into the configured tower
    hparams["text_tower"] = {"init_args": {"trust_remote_code": True}}


def _set_dict_kwargs(hparams: dict[str, Any], marker: Path) -> None:
    hparams["image_tower"]["dict_kwargs"] = {"norm_layer": marker_part(marker)}


# (case, edit of hyper_parameters, the key the refusal names, what it names)
CASES: list[tuple[str, Callable[[dict[str, Any], Path], None], str, str]] = [
    ("image_tower", _set_image_tower, "hyper_parameters.image_tower.class_path", MARKER_CLASS),
    ("text_tower", _set_text_tower, "hyper_parameters.text_tower.class_path", MARKER_CLASS),
    ("loss", _set_loss, "hyper_parameters.loss.class_path", MARKER_CLASS),
    ("rule", _set_rule, "hyper_parameters.param_groups.class_path", MARKER_CLASS),
    ("option_group", _set_option_group, "hyper_parameters.fusion", MARKER_CLASS),
    (
        "tower_option",
        _set_tower_option,
        "hyper_parameters.image_tower.init_args.kwargs.norm_layer",
        MARKER_CLASS,
    ),
    ("instantiator", _set_instantiator, "hyper_parameters._instantiator", MARKER_FUNCTION),
    ("part_as_text", _set_part_as_text, "hyper_parameters.image_tower", "not a record of a class"),
    ("part_without_class_path", _set_part_without_class_path, "hyper_parameters.text_tower", "not a record"),
    ("dict_kwargs", _set_dict_kwargs, "hyper_parameters.image_tower", MARKER_CLASS),
]


def write_variant(good: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    edit(checkpoint["hyper_parameters"])
    torch.save(checkpoint, out)
    torch.load(out, weights_only=True)  # still a plain-data checkpoint
    return out


def _cli(command: str, root: Path, path: Path, *extra: str) -> Callable[[], Any]:
    short = [
        "--trainer.limit_val_batches",
        "1",
        "--trainer.limit_test_batches",
        "1",
        "--trainer.limit_predict_batches",
        "1",
    ]
    # the checkpoint stopped at step 6, its one epoch done: a resume trains one more
    writer = {"EmbeddingWriter": {"output_dir": str(root / "predictions")}}
    args = [*tiny_demo_args(root, max_steps=7, callbacks=writer), "--trainer.max_epochs", "2", *short,
            "--ckpt_path", str(path), *extra]  # fmt: skip
    return lambda: cli_main([command, *args])


# every loader, as a user calls it: (name, call) with call(checkpoint, scratch folder)
LOADERS: dict[str, Callable[[Path, Path], Any]] = {
    "from_checkpoint": lambda path, tmp: DualEncoder.from_checkpoint(path),
    "load_from_checkpoint": lambda path, tmp: MultimodalModule.load_from_checkpoint(path),
    "export": lambda path, tmp: main(
        ["export", "--ckpt_path", str(path), "--format", "hf", "--out", str(tmp / "hf")]
    ),
    "zeroshot": lambda path, tmp: main(
        ["zeroshot", "--ckpt_path", str(path), "--data", str(tmp / "labeled")]
    ),
    "fit": lambda path, tmp: _cli("fit", tmp / "run", path)(),
    "validate": lambda path, tmp: _cli("validate", tmp / "run", path)(),
    "test": lambda path, tmp: _cli("test", tmp / "run", path)(),
    "predict": lambda path, tmp: _cli("predict", tmp / "run", path)(),
    "evaluate": lambda path, tmp: main(
        ["evaluate", "--output", str(tmp / "results"), *tiny_demo_args(tmp / "run"), "--ckpt_path", str(path)]
    ),
}


def refusal_of(call: Callable[[], Any], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a loader refuses with (raised, or printed by the command line with exit code 1 or 2)."""
    try:
        result = call()
    except UnsafeCheckpointError as err:
        return str(err)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        result = None
    else:
        assert result == 1, "the checkpoint was not refused"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "nothing it names was run" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "MARK"
    monkeypatch.setenv("HOSTILE_MARKER", str(path))
    return path


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("case,edit,key,named", CASES, ids=[c[0] for c in CASES])
def test_every_loader_refuses_a_hostile_part_in_one_line_without_running_it(
    tiny_run: TinyRun,
    tmp_path: Path,
    marker: Path,
    capsys: pytest.CaptureFixture[str],
    loader: str,
    case: str,
    edit: Callable[[dict[str, Any], Path], None],
    key: str,
    named: str,
) -> None:
    good = tiny_run.checkpoint_dir / "last.ckpt"
    path = write_variant(good, tmp_path / f"{case}.ckpt", lambda hparams: edit(hparams, marker))
    line = refusal_of(lambda: LOADERS[loader](path, tmp_path), capsys)
    assert not marker.exists()
    assert str(path) in line and key in line and named in line and "\n" not in line


@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_loader_takes_the_legitimate_checkpoint(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    """Control: the same checkpoint with its recorded parts loads and runs through every loader."""
    for label in ("circle", "square"):  # zeroshot's labeled images
        (tmp_path / "labeled" / label).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (32, 32), (40 * i, 200, 90)).save(tmp_path / "labeled" / label / f"{i}.png")
    try:
        result = LOADERS[loader](tiny_run.checkpoint_dir / "last.ckpt", tmp_path)
    except SystemExit as exit_info:  # a command's own refusal, after the checkpoint loaded
        result = exit_info.code
    captured = capsys.readouterr()
    if loader == "from_checkpoint":
        assert type(result.image_encoder).__name__ == "TorchvisionTower"
    elif loader == "load_from_checkpoint":
        assert type(result.model.text_encoder).__name__ == "HFTextTower"
    elif loader == "export":  # rebuilt, then refused for its format: HF has no such ResNet tower
        assert result == 1 and "image tower 'resnet_custom' (TorchvisionTower)" in captured.err
    elif loader == "zeroshot":
        assert result == 0 and "acc1=" in captured.out and "images=4" in captured.out
    elif loader == "evaluate":
        assert result == 0 and (tmp_path / "results" / "results.md").is_file()
    else:
        assert result.trainer.ckpt_path == str(tiny_run.checkpoint_dir / "last.ckpt")
    assert "nothing it names was run" not in captured.err


@pytest.mark.parametrize("part", ["image_tower", "text_tower", "loss"])
def test_the_payload_runs_when_called_unchecked(
    tiny_run: TinyRun, tmp_path: Path, marker: Path, part: str
) -> None:
    """Control: the recorded part leaves its marker when built unchecked, as every loader but Lightning's built
    a part before (``instantiate_class`` on the record)."""
    edit = {"image_tower": _set_image_tower, "text_tower": _set_text_tower, "loss": _set_loss}[part]
    path = write_variant(
        tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "part.ckpt", lambda h: edit(h, marker)
    )
    spec = torch.load(path, weights_only=True)["hyper_parameters"][part]
    instantiate_class((), spec).close()
    assert marker.exists()


@pytest.mark.parametrize("loader", ["export", "zeroshot", "from_checkpoint"])
def test_the_reported_popen_checkpoint_runs_nothing(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    mark = tmp_path / "MARK"

    def popen(hparams: dict[str, Any]) -> None:
        hparams["image_tower"] = {
            "class_path": "subprocess.Popen",
            "init_args": {"args": ["touch", str(mark)]},
        }

    path = write_variant(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "evil.ckpt", popen)
    line = refusal_of(lambda: LOADERS[loader](path, tmp_path), capsys)
    time.sleep(0.3)  # a started process would have touched it by now
    assert not mark.exists() and "subprocess.Popen" in line and "not a torch.nn.Module subclass" in line


def _activated_checkpoint(tmp_path: Path, activation: str) -> Path:
    from tests.models.helpers import cli_module, tiny_config

    image = {
        "class_path": "tests.template.user_parts.ActivatedPatchTower",
        "init_args": {"activation": "torch.tanh", "width": 12},
    }
    model = cli_module(tiny_config(image_tower=image, objective={"itm_weight": 0.0}), tmp_path / "cli")
    path = tmp_path / f"{activation}.ckpt"
    save_checkpoint(model, path)

    def name_activation(hparams: dict[str, Any]) -> None:
        hparams["image_tower"]["init_args"]["activation"] = activation

    return write_variant(path, path, name_activation)


def test_a_recorded_function_must_be_torchs(tmp_path: Path) -> None:
    network = DualEncoder.from_checkpoint(_activated_checkpoint(tmp_path, "torch.tanh")).eval()
    assert network.image_encoder.activation is torch.tanh  # control: torch's function loads
    assert torch.isfinite(network(make_batch())["image_embeddings"]).all()
    # control: the class's own default (a function of the user's code, not torch's) is not the record's choice
    path = _activated_checkpoint(tmp_path, "torch.tanh")
    write_variant(path, path, lambda hparams: hparams["image_tower"]["init_args"].pop("activation"))
    assert DualEncoder.from_checkpoint(path).image_encoder.activation is user_parts.halve
    assert MultimodalModule.load_from_checkpoint(path).model.image_encoder.activation is user_parts.halve
    for name in ("os.system", "subprocess.getoutput", "builtins.exit", "torch.hub.load", MARKER_FUNCTION):
        path = _activated_checkpoint(tmp_path, name)
        for load in (DualEncoder.from_checkpoint, MultimodalModule.load_from_checkpoint):
            with pytest.raises(
                UnsafeCheckpointError,
                match=r"init_args\.activation names .*, not one of torch's tensor functions",
            ):
                load(path)


def test_remote_code_is_switched_on_by_the_users_config_only(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def remote_code(hparams: dict[str, Any]) -> None:
        hparams["text_tower"]["init_args"]["trust_remote_code"] = True

    path = write_variant(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "remote.ckpt", remote_code)
    for load in (LOADERS["from_checkpoint"], LOADERS["load_from_checkpoint"], LOADERS["test"]):
        line = refusal_of(lambda load=load: load(path, tmp_path), capsys)
        assert "text_tower.init_args.trust_remote_code is true" in line
    # control: the user's own config asks for it, or builds the tower and passes it
    cli = _cli("test", tmp_path / "run", path, "--model.text_tower.init_args.trust_remote_code", "true")()
    assert cli.config.test.model.text_tower.init_args.trust_remote_code is True
    text_tower = cli.model.model.text_encoder
    assert DualEncoder.from_checkpoint(path, text_tower=text_tower).text_encoder is text_tower

    # the user's consent is for their own model: a checkpoint that names another one keeps it off
    def other_model(hparams: dict[str, Any]) -> None:
        hparams["text_tower"]["init_args"].update(name="someone/else", trust_remote_code=True)

    other = write_variant(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "other.ckpt", other_model)
    consent = ("--model.text_tower.init_args.trust_remote_code", "true")
    line = refusal_of(lambda: _cli("test", tmp_path / "run", other, *consent)(), capsys)
    assert "text_tower.init_args.trust_remote_code is true" in line


def test_an_adapter_option_that_names_a_module_is_refused(tiny_run: TinyRun, tmp_path: Path) -> None:
    def megatron(hparams: dict[str, Any]) -> None:
        options = {"r": 4, "megatron_config": {}, "megatron_core": "subprocess"}
        hparams["adapters"] = {
            "class_path": "mm_lightning.extras.PeftAdapters",
            "init_args": {"text": options},
        }

    path = write_variant(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "adapter.ckpt", megatron)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"hyper_parameters\.adapters\.init_args\.text\.megatron_config names a module for PeftAdapters",
    ):
        DualEncoder.from_checkpoint(path)


def test_lightning_is_outside_the_compromised_and_vulnerable_releases() -> None:
    """2.6.2 and 2.6.3 were compromised on the package index; before 2.6.6, ``load_from_checkpoint`` called the
    instantiator a checkpoint named (CVE-2026-58659)."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.version import Version

    assert Version(version("lightning")) >= Version("2.6.6")
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    (required,) = [
        Requirement(line.strip().strip('",'))
        for line in pyproject.splitlines()
        if line.strip().startswith('"lightning')
    ]
    assert not any(
        required.specifier.contains(v) for v in ("2.6.2", "2.6.3", "2.6.5")
    ) and required.specifier.contains("2.6.6")


def test_results_name_their_checkpoint_by_sha256(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tiny_run.checkpoint_dir / "last.ckpt"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert LOADERS["evaluate"](path, tmp_path) == 0
    (result,) = (tmp_path / "results").glob("*_zeroshot_retrieval.json")
    assert json.loads(result.read_text())["checkpoint_sha256"] == digest
    table = (tmp_path / "results" / "results.md").read_text()
    assert table.startswith(f"checkpoint: {path} (SHA-256 {digest})\n")
    capsys.readouterr()
    _cli("test", tmp_path / "run", path)()
    summary = capsys.readouterr().out
    assert f"  checkpoint: {path}\n    SHA-256 {digest}\n" in summary
    # control: another file has another digest
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"]["model.image_proj.weight"] += 1e-3
    other = tmp_path / "other.ckpt"
    torch.save(checkpoint, other)
    assert LOADERS["evaluate"](other, tmp_path) == 0
    assert (
        json.loads(result.read_text())["checkpoint_sha256"]
        == hashlib.sha256(other.read_bytes()).hexdigest()
        != digest
    )


@pytest.mark.parametrize("where", ["module_arguments", "hparams", "hparams_file.csv", "hparams_file.YAML"])
def test_load_from_checkpoint_checks_every_place_lightning_reads_arguments_from(
    tiny_run: TinyRun, tmp_path: Path, marker: Path, where: str
) -> None:
    good = tiny_run.checkpoint_dir / "last.ckpt"
    if where.startswith("hparams_file"):
        hparams = torch.load(good, weights_only=True)["hyper_parameters"]
        control = tmp_path / f"control.{where.split('.')[1]}"
        hostile = tmp_path / f"hostile.{where.split('.')[1]}"
        for path, image_tower in ((control, hparams["image_tower"]), (hostile, marker_part(marker))):
            if path.suffix == ".csv":  # Lightning's tags file: key,value rows, values read as Python literals
                rows = {**hparams, "image_tower": image_tower}
                path.write_text("key,value\n" + "".join(f'{k},"{v!r}"\n' for k, v in rows.items()))
            else:
                save_hparams_to_yaml(path, {**hparams, "image_tower": image_tower})
        loaded = MultimodalModule.load_from_checkpoint(
            good, hparams_file=control
        )  # control: the same record loads
        assert type(loaded.model.image_encoder).__name__ == "TorchvisionTower"
        with pytest.raises(
            UnsafeCheckpointError, match=r"hyper_parameters\.image_tower\.class_path names 'logging"
        ):
            MultimodalModule.load_from_checkpoint(good, hparams_file=hostile)
    else:
        checkpoint = torch.load(good, weights_only=True)
        # a past key Lightning still reads, for the arguments hyper_parameters leaves out
        checkpoint[where] = {"image_tower": checkpoint["hyper_parameters"].pop("image_tower")}
        torch.save(checkpoint, tmp_path / "control.ckpt")
        loaded = MultimodalModule.load_from_checkpoint(tmp_path / "control.ckpt")
        assert (
            type(loaded.model.image_encoder).__name__ == "TorchvisionTower"
        )  # control: the same record loads
        checkpoint[where] = {"image_tower": marker_part(marker)}
        path = tmp_path / "legacy.ckpt"
        torch.save(checkpoint, path)
        with pytest.raises(
            UnsafeCheckpointError, match=r"hyper_parameters\.image_tower\.class_path names 'logging"
        ):
            MultimodalModule.load_from_checkpoint(path)
    assert not marker.exists()


class Payload:
    """Pickles as a call of the marker function: stands for any command."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        from tests.resilience.hostile_payload import leave_marker

        return leave_marker, ()


def sharded_copy(good: Path, out: Path, **extra: Any) -> Path:
    """A single-file checkpoint as a sharded folder (DCP shards + Lightning's ``meta.pt``), written by one process."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    dcp.save({"state_dict": checkpoint.pop("state_dict"), **extra}, checkpoint_id=out, no_dist=True)
    checkpoint.pop("optimizer_states")  # sharded, they are restored by ShardedDataParallel only
    torch.save(checkpoint, out / "meta.pt")
    return out


def _hostile_index(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))


def _hostile_meta(folder: Path, marker: Path) -> None:
    meta = torch.load(folder / "meta.pt", weights_only=True)
    torch.save({**meta, "callbacks": Payload()}, folder / "meta.pt")


def _hostile_hparams(folder: Path, marker: Path) -> None:
    meta = torch.load(folder / "meta.pt", weights_only=True)
    _set_image_tower(meta["hyper_parameters"], marker)
    torch.save(meta, folder / "meta.pt")


# (case, edit of the folder, the file the refusal names, what it says)
FOLDER_CASES = [
    ("index", _hostile_index, ".metadata", "could run code"),
    ("meta", _hostile_meta, "meta.pt", "cannot be loaded as data"),
    ("hparams", _hostile_hparams, "", "hyper_parameters.image_tower.class_path"),
]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("case,edit,file,says", FOLDER_CASES, ids=[c[0] for c in FOLDER_CASES])
def test_every_loader_refuses_a_hostile_sharded_folder_in_one_line(
    tiny_run: TinyRun,
    tmp_path: Path,
    marker: Path,
    capsys: pytest.CaptureFixture[str],
    loader: str,
    case: str,
    edit: Callable[[Path, Path], None],
    file: str,
    says: str,
) -> None:
    folder = sharded_copy(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "sharded.ckpt")
    edit(folder, marker)
    try:
        result = LOADERS[loader](folder, tmp_path)
    except (UnsafeCheckpointError, CheckpointFileError) as err:
        lines = [str(err)]
    except SystemExit as exit_info:
        assert exit_info.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if str(folder) in line]
    else:
        assert result == 1, "the folder was not refused"
        lines = [line for line in capsys.readouterr().err.splitlines() if str(folder) in line]
    assert not marker.exists()
    assert len(lines) == 1 and str(folder / file) in lines[0] and says in lines[0], lines


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("loader", ["fit", "validate", "test", "predict", "evaluate"])
def test_the_commands_refuse_a_folder_whose_entry_names_a_function(
    tiny_run: TinyRun, tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    """Every --ckpt_path reads a folder's non-tensor entries as data first: whichever strategy then loads it
    (Lightning's own read them with torch's reader) finds only checked values."""
    folder = sharded_copy(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "sharded.ckpt", notes=Payload())
    with pytest.raises(SystemExit) as exit_info:
        LOADERS[loader](folder, tmp_path)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "entry 'notes'" in line]
    assert not marker.exists()
    assert len(lines) == 1 and "cannot be loaded as data" in lines[0], lines


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_fit_on_one_device_refuses_to_resume_a_sharded_folder(tiny_run: TinyRun, tmp_path: Path) -> None:
    folder = sharded_copy(tiny_run.checkpoint_dir / "last.ckpt", tmp_path / "sharded.ckpt")
    with pytest.raises(
        CheckpointFileError, match=r"is a sharded checkpoint: a fit resumes it under the sharded strategy"
    ):
        LOADERS["fit"](folder, tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    "loader", ["from_checkpoint", "load_from_checkpoint", "export", "zeroshot", "test", "evaluate"]
)
def test_every_reader_takes_a_legitimate_sharded_folder(
    tiny_run: TinyRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], loader: str
) -> None:
    """Control: the same folder, not edited, loads whole in one process (the commands' consolidating step)."""
    good = tiny_run.checkpoint_dir / "last.ckpt"
    folder = sharded_copy(good, tmp_path / "sharded.ckpt")
    for label in ("circle", "square"):
        (tmp_path / "labeled" / label).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (32, 32), (40 * i, 200, 90)).save(tmp_path / "labeled" / label / f"{i}.png")
    try:
        result = LOADERS[loader](folder, tmp_path)
    except SystemExit as exit_info:  # a command's own refusal, after the checkpoint loaded
        result = exit_info.code
    captured = capsys.readouterr()
    expected = torch.load(good, weights_only=True)["state_dict"]
    if loader == "from_checkpoint":
        weights = {f"model.{k}": v for k, v in result.state_dict().items()}
        assert all(torch.equal(weights[k], v) for k, v in expected.items())
    elif loader == "load_from_checkpoint":
        assert all(torch.equal(result.state_dict()[k], v) for k, v in expected.items())
    elif loader == "export":  # rebuilt, then refused for its format, as the file is
        assert result == 1 and "image tower 'resnet_custom' (TorchvisionTower)" in captured.err
    elif loader == "zeroshot":
        assert result == 0 and "acc1=" in captured.out
    elif loader == "evaluate":
        results = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
        assert result == 0 and results.get("checkpoint_sha256") == sha256_of(folder)
    else:
        assert result.trainer.ckpt_path == str(folder)
        assert all(torch.equal(result.model.state_dict()[k], v) for k, v in expected.items())
