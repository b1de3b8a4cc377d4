"""``benchmarks/gpu_check.py --quick`` (the dry run on a few small photos, in a temporary folder): every stage of
the GPU check runs on CPU at tiny sizes, so the check works on the day a GPU is there; a stage that fails is
recorded and the next one still runs; one that outlives its bound is stopped with the processes it started.

The quick run's ddp stage (the explicit all-reduce through the CLI on 2 CPU processes; tests/test_strategies_cli.py
compares that strategy with DDP through the CLI) is the one stopped at its bound: 3 s, which no 2-process
Lightning run finishes in, while the stage starts its first process at once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests import preloaded
from tests.conftest import REPO

SCRIPT = [sys.executable, "benchmarks/gpu_check.py", "--quick"]


def test_the_quick_run_runs_every_stage_and_stops_one_past_its_bound_with_what_it_started(
    tmp_path: Path,
) -> None:
    out = tmp_path / "check.json"
    done = preloaded.run([*SCRIPT, "--out", str(out)], capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    assert list(stages) == [
        "env", "train_eager", "train_compiled", "train_no_itm", "profile", "loader_fed", "nvjpeg", "grad_cache", "fsdp2", "cuda_tests",
        "train_resnet50", "ddp",
    ]  # fmt: skip
    failed = {name: stage for name, stage in stages.items() if stage["status"] != "ok" and name != "ddp"}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    for name in ("train_eager", "train_compiled", "train_no_itm", "loader_fed", "train_resnet50"):
        assert stages[name]["samples_per_s"] > 0 and stages[name]["tflops_per_s"] > 0, stages[name]
    assert stages["grad_cache"]["chunks_4"]["step_ms"] > 0 and stages["nvjpeg"]["decode_per_s"] > 0
    assert stages["fsdp2"]["fsdp2"]["step_ms"] > 0 and stages["fsdp2"]["single_device"]["step_ms"] > 0
    assert 0 < stages["profile"]["matmul_attention_share"] < 1 and stages["profile"]["top"]
    assert "7 tests collected" in stages["cuda_tests"]["summary"]
    assert stages["ddp"]["status"] == "timed out after 3 s", stages["ddp"]
    # the 2-process training it had started went with it
    left = subprocess.run(["pgrep", "-f", "gpu_check_.*/ddp_"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT gpu_check mfu=None samples_per_s=\d+ \(.*\)", last), last


def test_a_failing_stage_is_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    missing = tmp_path / "no_photos.jsonl"
    done = subprocess.run(
        [*SCRIPT, "--out", str(out), "--photos", str(missing), "--stages", "nvjpeg", "env"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(out.read_text())["stages"]
    assert stages["nvjpeg"]["status"] == "failed" and "no_photos.jsonl" in stages["nvjpeg"]["error"]
    assert stages["env"]["status"] == "ok"
