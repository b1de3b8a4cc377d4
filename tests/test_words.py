"""Shipped files (package, configs, docs, README, benchmarks, examples, notebooks) use no words of this project's own
history that mean nothing to a user: "the seeds" (the code it started from), "device session", "this round"."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

JARGON = re.compile(r"the seeds|seeds'|device sessions?|\b(this|last|next|previous) rounds?\b", re.IGNORECASE)


def jargon_in(files: dict[str, str]) -> list[str]:
    """``path:line: text`` for every line that uses one of the words."""
    return [
        f"{path}:{number}: {line.strip()}"
        for path, text in files.items()
        for number, line in enumerate(text.splitlines(), 1)
        if JARGON.search(line)
    ]


def shipped_files() -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    paths = [p for p in listed.splitlines() if not p.startswith("tests/") and (REPO / p).is_file()]
    return {p: (REPO / p).read_text(errors="ignore") for p in paths}


def test_no_jargon_in_shipped_files() -> None:
    assert jargon_in(shipped_files()) == []


def test_control_the_words_are_found() -> None:
    found = jargon_in({
        "a.py": "# the seeds' loop\nrandom seed 0\n", "b.md": "measured in the last round\nrounds of timing\n",
        "c.yaml": "# ran out in the device session\n",
    })  # fmt: skip
    assert found == [
        "a.py:1: # the seeds' loop", "b.md:1: measured in the last round", "c.yaml:1: # ran out in the device session",
    ]  # fmt: skip
