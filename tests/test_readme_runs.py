"""Every ``python -m mm_lightning`` command of the README and ``docs/`` that can run offline on a CPU is run, on
tiny data (the generated demo, shrunk): the command as written, with the data, run folder and length shrunk by
options appended after it. The others are named below with the reason (a GPU, two processes, files of the user's).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from mm_lightning.cli import main
from tests.conftest import REPO, TinyRun
from tests.test_readme_commands import COMMANDS

# Commands not run here, by what they need; each is checked elsewhere as said.
GPU_RECIPE = (
    "configs/base.yaml trains on GPUs with downloaded weights (its offline errors: test_first_run.py)"
)
TWO_PROCESSES = "two processes (test_strategies_cli.py runs ddp and ddp_explicit through the CLI)"
USERS_FILES = "a model folder of the user's (/models/...)"
HELP = "help text (test_readme_commands.py parses it)"
HF_EXPORT = (
    "export of a run with the towers its format takes (tests/towers/test_export_dual_encoder.py,"
    " test_export_sentence_transformers.py)"
)
EARLIER_OUTPUT = (
    "an earlier evaluate's output (test_evaluate.py compares two evaluations of the same test set)"
)


def why_not_run(argv: list[str]) -> str | None:
    """The reason a command is not run here, or ``None``."""
    joined = " ".join(argv)
    if "--trainer.devices 2" in joined or "--trainer.devices -1" in joined or "--trainer.num_nodes" in joined:
        return TWO_PROCESSES
    if "/models/" in joined or "finetune_clip" in joined:
        return USERS_FILES
    if any(a.endswith(".help") or a == "--help" for a in argv):
        return HELP
    if argv[0] == "fit" and "configs/base.yaml" in argv:
        return GPU_RECIPE
    if argv[0] == "export":
        return HF_EXPORT
    if "--compare_to" in argv:
        return EARLIER_OUTPUT
    return None


# each distinct command once (the README and docs repeat some)
RUNNABLE = list(
    {tuple(argv): (line, argv) for line, argv in reversed(COMMANDS) if why_not_run(argv) is None}.values()
)


def test_most_commands_run_and_the_others_say_why() -> None:
    assert len(RUNNABLE) >= 12, [line for line, _ in RUNNABLE]
    reasons = {why_not_run(argv) for _, argv in COMMANDS} - {None}
    assert reasons <= {GPU_RECIPE, TWO_PROCESSES, USERS_FILES, HELP, HF_EXPORT, EARLIER_OUTPUT}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory, tiny_run: TinyRun) -> Path:
    """A working directory where the README's relative paths resolve: the repository's configs and examples, the
    demo's files under the names the docs use, a checkpoint where they expect one, a labeled image folder."""
    root = tmp_path_factory.mktemp("readme")
    for name in ("configs", "examples"):
        (root / name).symlink_to(REPO / name)
    demo = tiny_run.root / "demo"
    for folder in ("my", "data/coco"):  # a user's JSONL files: 48 records of each split, their images beside
        (root / folder).mkdir(parents=True)
        (root / folder / "images").symlink_to(demo / "images")
        for split in ("train", "val"):
            lines = (demo / f"{split}.jsonl").read_text().splitlines(keepends=True)[:48]
            (root / folder / f"{split}.jsonl").write_text("".join(lines))
    for path in ("logs/demo/checkpoints", "."):
        (root / path).mkdir(parents=True, exist_ok=True)
        os.link(tiny_run.checkpoint_dir / "last.ckpt", root / path / "last.ckpt")
    # the standard test sets under the names the docs use: the demo's test split, a two-class "ImageNet"
    test_lines = (demo / "test.jsonl").read_text().splitlines(keepends=True)[:24]
    (root / "data/coco/coco5k_test.jsonl").write_text("".join(test_lines))
    (root / "imagenet_classes.txt").write_text("tench\ngoldfish\n")
    for folder, classes in (
        ("data/pets/val", ("cat", "dog")),
        ("data/imagenet/val", ("n01440764", "n01443537")),
    ):
        for label, colour in zip(classes, ((200, 40, 40), (40, 40, 200)), strict=True):
            (root / folder / label).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 40), colour).save(root / folder / label / f"{i}.png")
    return root


FITTED: set[tuple[str, ...]] = set()  # the runs fit_before made in this session's sandbox


def fit_before(argv: list[str], sandbox: Path, fitted: set[tuple[str, ...]]) -> None:
    """For a command that reads ``--ckpt_path last`` or ``best`` of its config's run: that run's fit (validated at
    its last step, so it keeps a best checkpoint), where the config puts its checkpoints (its own
    ``default_root_dir``, inside the sandbox), with the command's model options."""
    config = argv[argv.index("--config") + 1]
    model = [a for i, a in enumerate(argv) if a.startswith("--model.") or argv[i - 1].startswith("--model.")]
    fit = ("fit", "--config", config, *model)
    if (str(sandbox), *fit) in fitted:
        return
    data = [
        "--data.init_args.train_file",
        "data/coco/train.jsonl",
        "--data.init_args.val_file",
        "data/coco/val.jsonl",
        "--trainer.val_check_interval",
        "2",
    ]
    assert main(shrunk([*fit, *data], sandbox, "", run_dir=None)) == 0
    fitted.add((str(sandbox), *fit))


def shrunk(argv: list[str], sandbox: Path, line: str, run_dir: str | None = "") -> list[str]:
    """The command with options appended that keep its run tiny and inside the sandbox (in a run folder of its
    own, unless ``run_dir`` is None: the config's own, as ``--ckpt_path last`` reads it)."""
    if argv[0] == "zeroshot":
        return argv
    if argv[0] == "evaluate":  # its own options, then test's (shrunk as below)
        argv = [*argv, "--output", str(sandbox / "evaluation")]
    if run_dir is not None:
        run_dir = str(sandbox / "runs" / line.replace("/", "_").replace(":", "_"))
    data = ["--data.init_args.batch_size", "16", "--data.init_args.num_workers", "0"]
    if "demo" in " ".join(argv):  # the generated demo (demo.yaml, demo_data.yaml, shards.yaml): made small
        data += [
            "--data.init_args.data_dir", str(sandbox / "demo"), "--data.init_args.render_size", "32",
            "--data.init_args.train_renders", "1", "--data.init_args.num_val", "24",
            "--data.init_args.num_test", "24",
        ]  # fmt: skip
    if argv[0] == "audit":
        return [*argv, *data, "--audit.progress", "false"]
    if argv[0] == "shard":
        return [*argv, *data, "--progress", "false"]
    return [
        *argv, *data,
        "--model.image_tower.init_args.image_size", "32",
        "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "1",
        "--trainer.enable_progress_bar", "false",
        *(["--trainer.default_root_dir", run_dir] if run_dir is not None else []),
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("line", "argv"), RUNNABLE, ids=[line for line, _ in RUNNABLE])
def test_readme_command_runs(
    line: str, argv: list[str], sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(sandbox)
    if argv[0].startswith("PYTHONPATH="):
        monkeypatch.syspath_prepend(str(REPO / argv[0].split("=", 1)[1]))
        argv = argv[1:]
    if "--ckpt_path" in argv and argv[argv.index("--ckpt_path") + 1] in ("last", "best"):
        fit_before(argv, sandbox, FITTED)
        assert main(shrunk(argv, sandbox, line, run_dir=None)) == 0
        return
    assert main(shrunk(argv, sandbox, line)) == 0
