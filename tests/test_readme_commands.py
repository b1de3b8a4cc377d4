"""Every ``python -m mm_lightning ...`` command in the README and ``docs/`` parses, and the CLI lists every command
it has.

Training commands are parsed with ``--print_config`` (the whole config is built and checked, nothing runs);
``export`` and ``zeroshot`` with their own parsers, ``evaluate`` with its own and ``test``'s.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mm_lightning.cli import STANDALONE_COMMANDS, cli_main, main
from mm_lightning.commands import evaluate, export, zeroshot
from mm_lightning.commands.audit import AuditOptions
from mm_lightning.config_parser import data_config_parser
from mm_lightning.extras.shards.writer import ShardOptions
from tests.conftest import REPO

STANDALONE_PARSERS = {
    "export": export.build_parser,
    "zeroshot": zeroshot.build_parser,
    "audit": lambda: data_config_parser("audit", AuditOptions, "audit"),
    "shard": lambda: data_config_parser("shard", ShardOptions),
}


def readme_commands(text: str) -> list[tuple[int, list[str]]]:
    """``(line, argv after "mm_lightning")`` of every command in the README's code blocks, fenced or indented
    (continuations joined, comments dropped)."""
    commands, in_block, pending, start = [], False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not (in_block or raw.startswith("    ") or pending):  # fenced or indented code blocks
            continue
        if not pending:
            start = number
        pending += " " + line.removesuffix("\\")
        if line.endswith("\\"):
            continue
        found = re.search(r"(?:^|\s)-m mm_lightning\s+(.*)", pending)
        if found:
            path = re.match(
                r"\s*PYTHONPATH=(\S+)\s", pending
            )  # the user's own code, e.g. PYTHONPATH=examples/x
            command = found.group(1)
            if "bash -c '" in pending:  # a command a launcher runs through bash: its closing quote
                command = command.rstrip().removesuffix("'")
            # environment variables the launcher sets (SLURM_JOB_NUM_NODES, GROUP_WORLD_SIZE...): a count
            argv = shlex.split(re.sub(r'"\$[A-Z_]+"', "2", command), comments=True)
            commands.append((start, [f"PYTHONPATH={path.group(1)}", *argv] if path else argv))
        pending = ""
    return commands


PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMANDS = [
    (f"{page.relative_to(REPO)}:{line}", argv)
    for page in PAGES
    for line, argv in readme_commands(page.read_text())
]


def test_the_readme_has_commands_of_every_kind() -> None:
    kinds = {argv[0] for _, argv in COMMANDS} | {
        argv[1] for _, argv in COMMANDS if argv[0].startswith("PYTHONPATH=")
    }
    assert {"fit", "audit", "shard", "predict", "evaluate", "export", "zeroshot"} <= kinds, kinds
    assert len(COMMANDS) >= 20


def parses(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    """Raises if ``argv`` (after ``python -m mm_lightning``) does not parse."""
    if argv[0] in STANDALONE_PARSERS:
        STANDALONE_PARSERS[argv[0]]().parse_args(argv[1:])
        return
    if argv[0] == "evaluate":  # its own options, then every option of `test`
        _, argv = evaluate.build_parser().parse_known_args(argv[1:])
        argv = ["test", *argv]
    asks_help = any(a == "--help" or a.endswith(".help") for a in argv)  # prints and exits by itself
    with pytest.raises(SystemExit) as done:
        cli_main(
            argv if asks_help else [*argv, "--print_config"]
        )  # exits after parsing, before anything is built
    output = capsys.readouterr()
    assert done.value.code in (0, None), output.err[-3000:]
    assert "--" in output.out if asks_help else "trainer:" in output.out


@pytest.mark.parametrize(("line", "argv"), COMMANDS, ids=[line for line, _ in COMMANDS])
def test_readme_command_parses(
    line: str, argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository
    if argv[0].startswith("PYTHONPATH="):
        monkeypatch.syspath_prepend(str(REPO / argv[0].split("=", 1)[1]))
        argv = argv[1:]
    parses(argv, capsys)


def test_a_broken_command_is_caught(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the same check fails for an option that does not exist and a config file that does not."""
    monkeypatch.chdir(REPO)
    with pytest.raises(AssertionError):
        parses(["fit", "--config", "configs/demo.yaml", "--trainer.no_such_option", "1"], capsys)
    with pytest.raises(AssertionError):
        parses(["fit", "--config", "configs/no_such_recipe.yaml"], capsys)
    with pytest.raises(SystemExit):
        parses(["export", "--ckpt_path", "last.ckpt", "--format", "onnx", "--out", "x"], capsys)


def test_strategy_class_takes_nested_options(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/scaling.md: ``--trainer.strategy <class>`` with ``--trainer.strategy.<option>``; a registry name
    takes none, and the error names the class to give."""
    monkeypatch.chdir(REPO)
    argv = ["--config", "configs/demo.yaml", "--trainer.strategy"]  # run=False: no subcommand
    nested = ["--trainer.strategy.mode", "per_parameter", "--trainer.strategy.timeout_s", "300"]
    cli = cli_main([*argv, "mm_lightning.extras.ExplicitAllReduceDDPStrategy", *nested], run=False)
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == "ExplicitAllReduceDDPStrategy"
    assert (strategy.mode, strategy.timeout_s) == ("per_parameter", 300.0)
    plain = cli_main([*argv, "ddp_explicit"], run=False)  # the registry name alone
    assert type(plain.trainer.strategy).__name__ == "ExplicitAllReduceDDPStrategy"
    assert plain.trainer.strategy.mode == "bucketed"
    with pytest.raises(SystemExit):
        cli_main([*argv, "ddp_explicit", *nested], run=False)
    assert "--trainer.strategy mm_lightning.extras.ExplicitAllReduceDDPStrategy" in capsys.readouterr().err


def test_help_lists_every_command(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for name in ("fit", "validate", "test", "predict", "audit", "shard", *STANDALONE_COMMANDS):
        assert re.search(rf"^\s+{name}\s+\S", out, re.MULTILINE), (name, out)
    with pytest.raises(SystemExit) as done:
        main(["export", "--help"])  # what the listing tells a user to run
    assert done.value.code == 0 and "--ckpt_path" in capsys.readouterr().out


def test_commands_are_found_in_continued_and_indented_blocks(tmp_path: Path) -> None:
    text = "```bash\n    python -m mm_lightning fit --config a.yaml \\\n        --trainer.devices 2  # two\n```\n"
    text += "prose: `python -m mm_lightning fit --not-code`\n```\ntorchrun -m mm_lightning audit --x 1\n```\n"
    text += "\n    python -m mm_lightning zeroshot --data d\n"
    assert readme_commands(text) == [
        (2, ["fit", "--config", "a.yaml", "--trainer.devices", "2"]),
        (7, ["audit", "--x", "1"]),
        (10, ["zeroshot", "--data", "d"]),
    ]
