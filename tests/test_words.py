"""Shipped files (package, configs, docs, README, benchmarks, examples, notebooks) use no words of this project's own
history that mean nothing to a user: "the seeds" (the code it started from), "device session", "this round"; and
the package's code carries no benchmark figures (they go stale there: docs/benchmarks.md has them, with the
command that measures them)."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

JARGON = re.compile(
    r"the seeds|seeds'|the seed's|device sessions?|\b(this|last|next|previous) rounds?\b", re.IGNORECASE
)
FIGURE = re.compile(r"\d(\.\d+)? ?(ms|µs)\b|\d(\.\d+)? ?×|\d(\.\d+)?x (faster|slower)|\d ?% of ")


def jargon_in(files: dict[str, str], pattern: re.Pattern = JARGON) -> list[str]:
    """``path:line: text`` for every line that matches ``pattern``."""
    return [
        f"{path}:{number}: {line.strip()}"
        for path, text in files.items()
        for number, line in enumerate(text.splitlines(), 1)
        if pattern.search(line)
    ]


def shipped_files() -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    paths = [p for p in listed.splitlines() if not p.startswith("tests/") and (REPO / p).is_file()]
    return {p: (REPO / p).read_text(errors="ignore") for p in paths}


def test_no_jargon_in_shipped_files() -> None:
    assert jargon_in(shipped_files()) == []


def test_control_the_words_are_found() -> None:
    found = jargon_in(
        {
            "a.py": "# the seeds' loop\nrandom seed 0\n# The seed's loop\n",
            "b.md": "measured in the last round\nrounds of timing\n",
            "c.yaml": "# ran out in the device session\n",
        }
    )
    assert found == [
        "a.py:1: # the seeds' loop",
        "a.py:3: # The seed's loop",
        "b.md:1: measured in the last round",
        "c.yaml:1: # ran out in the device session",
    ]


def test_no_benchmark_figures_in_the_package() -> None:
    package = {
        p: text for p, text in shipped_files().items() if p.startswith("mm_lightning/") and p.endswith(".py")
    }
    assert package and jargon_in(package, FIGURE) == []


def test_control_figures_are_found() -> None:
    code = "# 1.8 vs 3.5 ms per batch\n# 2.7x faster\n# 4 workers, 32x3x224x224\n# ~6 % of the work\n"
    assert jargon_in({"a.py": code}, FIGURE) == [
        "a.py:1: # 1.8 vs 3.5 ms per batch", "a.py:2: # 2.7x faster", "a.py:4: # ~6 % of the work",
    ]  # fmt: skip
