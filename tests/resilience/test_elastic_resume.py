"""Resume on another number of processes through the real CLI: a run on 2 processes is SIGKILLed mid-epoch and
resumed on 1 and on 3. The epoch's samples are read once each and the epoch ends with its last one; with the global
batch kept (2 x 4 -> 1 x 8) the weights equal an uninterrupted run's up to reduction-order noise. The same global
batch split by modality (configs/modality_parallel.yaml: each tower on its own process) equals DDP's steps too, on
the demo's own towers (BatchNorm, dropout, the matching head)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mm_lightning.checkpoints.sharded import (
    is_sharded_checkpoint,
    read_entries,
    read_metadata,
    read_sharded_checkpoint,
)
from mm_lightning.cli import main
from mm_lightning.data.demo import demo_generator_args, generate_demo_dataset
from mm_lightning.data.resume import ResumableDataLoader
from mm_lightning.models.optim import param_groups
from tests.conftest import DEMO_CONFIG, REPO, callback_args
from tests.resilience.helpers import recorded_samples
from tests.strategies.launch import RankResult, free_port, kill_all, run_ranks
from tests.test_process_exit import exit_problems, run_or_report_hang

unpatched = ResumableDataLoader.load_position
IMAGES = 48  # training images: whole steps of 2 x 4, 1 x 4, 1 x 8 and 3 x 4 samples
KILLED_AT = 3  # steps of 2 x 4 = 24 samples, half the epoch
# A resumed 2 x 4 -> 1 x 8 run against an uninterrupted 1 x 8 one, relative L2 distances. Measured (6 steps):
# parameters 2.4e-5 (an uninterrupted 2 x 4 run is 1.5e-5 from it: the gradient all-reduce's reduction order,
# which AdamW's normalized steps carry into the weights), the gradients' running mean (AdamW's exp_avg) 4.7e-7;
# one batch left out: 2.8e-3 and 0.92.
PARAMETER_TOLERANCE, GRADIENT_TOLERANCE = 1e-4, 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    generate_demo_dataset(root / "demo", **demo_generator_args(32, 1, 24, 24, 0))
    (root / "images").symlink_to(root / "demo" / "images")
    for split, rows in (("train", IMAGES), ("val", 24)):
        lines = (root / "demo" / f"{split}.jsonl").read_text().splitlines(keepends=True)[:rows]
        (root / f"{split}.jsonl").write_text("".join(lines))
    return root


def fit_args(
    data: Path,
    run: Path,
    world: int,
    batch: int,
    kill_at: int | None = None,
    leave_rank: int | None = None,
    epochs: int = 1,
    every_step: bool = True,
    data_module: dict[str, Any] | None = None,
    demo_towers: bool = False,
) -> list[str]:
    """``epochs`` epochs, deterministic, last.ckpt every step (or at epoch ends); no draw that depends on the rank (dropout, hard
    negatives) and no statistics of a rank's own batch (BatchNorm), so only the layout differs between runs; or the
    demo's own towers, which have them all."""
    module = data_module or {
        "class_path": "mm_lightning.data.MultimodalDataModule",
        "init_args": {"train_file": str(data / "train.jsonl"), "val_file": str(data / "val.jsonl")},
    }
    init_args = {
        **module["init_args"],
        "batch_size": batch,
        "num_workers": 0,
        "loader": {"caption_sampling": "random"},
    }
    recorder = {"out": str(run / "samples"), "kill_at_step": kill_at, "leave_rank": leave_rank}
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    vit = {"patch_size": 8, "num_layers": 1, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64}
    towers = [
        "--model.image_tower.init_args.name",
        "vit_custom",  # LayerNorm: no statistics of a rank's batch
        "--model.image_tower.init_args.kwargs",
        json.dumps(vit),
        "--model.image_tower.init_args.image_size",
        "32",
        "--model.text_tower.init_args.config_overrides",
        json.dumps(no_dropout),
        "--model.objective.itm_weight",
        "0",
    ]
    return [
        "fit", "--config", str(DEMO_CONFIG),
        "--data", json.dumps({"class_path": module["class_path"], "init_args": init_args}),
        *([] if demo_towers else towers),
        "--trainer.devices", str(world),
        *(["--trainer.strategy", "ddp"] if world > 1 else []),
        "--trainer.max_epochs", str(epochs),
        "--trainer.limit_val_batches", "0",
        "--trainer.deterministic", "true",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run),
        *callback_args(run, checkpoint={"every_n_train_steps": 1 if every_step else None}),
        "--trainer.callbacks+", json.dumps({"class_path": "tests.resilience.helpers.RecordSamples",
                                            "init_args": recorder}),
    ]  # fmt: skip


def launch(args: list[str], killed: bool = False) -> list[str]:
    """Runs ``python -m mm_lightning <args>``, every process at once as torchrun starts them (Lightning's own
    launcher starts the others only once the first has built its trainer); each ends cleanly, or by the SIGKILL it
    was told to send itself. Returns each process's output."""
    world = int(args[args.index("--trainer.devices") + 1])
    if world == 1:
        done = run_or_report_hang([sys.executable, "-m", "mm_lightning", *args], timeout=300)
        results = [RankResult(done.returncode, done.stdout)]
    else:
        with tempfile.TemporaryDirectory() as logs:
            results = run_ranks(["-m", "mm_lightning", *args], Path(logs), world, timeout=300)
    for result in results:
        if killed:
            assert result.returncode == -9 and "Traceback" not in result.output, result.output[-5000:]
        else:
            assert exit_problems(result.returncode, result.output) == [], result.output[-5000:]
    return [result.output for result in results]


@pytest.fixture(scope="module")
def killed_on_two(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 4 DDP run SIGKILLed as step 3 begins, after its checkpoint: DDP's weights after 3 steps (tests resume
    copies of it)."""
    run = tmp_path_factory.mktemp("killed_on_two") / "run"
    launch(fit_args(data, run, 2, 4, kill_at=KILLED_AT), killed=True)
    assert last(run)["global_step"] == KILLED_AT
    return run


@pytest.fixture(scope="module")
def ddp_epoch(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole epoch of 2 x 4 under DDP with the demo's own towers: step=3.ckpt and step=6.ckpt, and last.ckpt
    written at the epoch's end (the default callbacks')."""
    run = tmp_path_factory.mktemp("ddp_epoch") / "run"
    at_steps = {"monitor": None, "every_n_train_steps": 3, "save_top_k": -1, "filename": "step={step}"}
    options = [
        f"--best_checkpoint.{key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in at_steps.items()
    ]
    launch([*fit_args(data, run, 2, 4, every_step=False, demo_towers=True), *options])
    return run


def last(run: Path) -> dict[str, Any]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def resumed_copy(killed: Path, to: Path) -> Path:
    shutil.copytree(killed, to)
    return to


def seen_in(killed: Path, resumed: Path) -> Counter:
    """The samples the killed run trained on before its checkpoint and those the resumed run read after it (the
    resumed run's folder is a copy of the killed one's, its records included)."""
    before, after = range(KILLED_AT), range(KILLED_AT, 10**6)
    return Counter(
        recorded_samples(killed / "samples", before) + recorded_samples(resumed / "samples", after)
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_killed_on_2_processes_resumes_on_1_and_3_reading_each_sample_once(
    data: Path, killed_on_two: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = killed_on_two
    epoch = Counter(range(IMAGES))

    # 3 processes x 4: the 24 samples left make 2 steps; the epoch ends there (and the run with it).
    on_three = resumed_copy(killed, tmp_path / "three")
    launch([*fit_args(data, on_three, 3, 4), "--ckpt_path", "last"])
    assert seen_in(killed, on_three) == epoch
    assert last(on_three)["global_step"] == KILLED_AT + 2

    # 1 process x 4: 6 steps left.
    on_one = resumed_copy(killed, tmp_path / "one")
    assert main([*fit_args(data, on_one, 1, 4), "--ckpt_path", "last"]) == 0
    assert seen_in(killed, on_one) == epoch
    assert last(on_one)["global_step"] == KILLED_AT + 6

    # Control: the position kept as a per-process batch count (what each rank's own loader state gives) makes
    # the same resume read some samples twice and miss others, and the check sees it.
    def per_process_count(self: ResumableDataLoader, state: dict[str, Any]) -> None:
        saved = state[ResumableDataLoader.KEY]
        steps = saved["consumed"] // (saved["world_size"] * saved["batch_size"])
        unpatched(self, {ResumableDataLoader.KEY: {**saved, "consumed": steps * self.sampler.global_batch}})

    control = resumed_copy(killed, tmp_path / "control")
    monkeypatch.setattr(ResumableDataLoader, "load_position", per_process_count)
    assert main([*fit_args(data, control, 1, 4), "--ckpt_path", "last"]) == 0
    assert seen_in(killed, control) != epoch


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_same_global_batch_on_fewer_processes_gives_the_uninterrupted_weights(
    data: Path, killed_on_two: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = tmp_path / "full"
    assert main(fit_args(data, full, 1, 8)) == 0
    expected = last(full)
    assert expected["global_step"] == IMAGES // 8

    killed = resumed_copy(killed_on_two, tmp_path / "killed")
    control = resumed_copy(killed_on_two, tmp_path / "control")
    assert main([*fit_args(data, killed, 1, 8), "--ckpt_path", "last"]) == 0
    resumed = last(killed)
    assert resumed["global_step"] == expected["global_step"]
    parameters, gradients = distances(resumed, expected)
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE, (parameters, gradients)

    # Control: the same resume with one batch left out ends outside both tolerances.
    def skip_a_batch(self: ResumableDataLoader, state: dict[str, Any]) -> None:
        saved = dict(state[ResumableDataLoader.KEY])
        saved["consumed"] += saved["world_size"] * saved["batch_size"]
        unpatched(self, {ResumableDataLoader.KEY: saved})

    monkeypatch.setattr(ResumableDataLoader, "load_position", skip_a_batch)
    assert main([*fit_args(data, control, 1, 8), "--ckpt_path", "last"]) == 0
    parameters, gradients = distances(last(control), expected)
    assert parameters > 10 * PARAMETER_TOLERANCE and gradients > 1000 * GRADIENT_TOLERANCE


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Relative L2 distance, in float64."""
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


def distances(checkpoint: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float]:
    """Relative L2 distances of the parameters and of AdamW's running mean of the gradients."""

    def weights(ckpt: dict[str, Any]) -> torch.Tensor:
        state = ckpt["state_dict"]
        return torch.cat(
            [state[k].double().reshape(-1) for k in sorted(state) if state[k].is_floating_point()]
        )

    def gradient_means(ckpt: dict[str, Any]) -> torch.Tensor:
        state = ckpt["optimizer_states"][0]["state"]
        return torch.cat([state[i]["exp_avg"].double().reshape(-1) for i in sorted(state)])

    return (
        relative(weights(checkpoint), weights(reference)),
        relative(gradient_means(checkpoint), gradient_means(reference)),
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_elastic_restarts_on_fewer_nodes_and_finishes_the_epoch(data: Path, tmp_path: Path) -> None:
    """docs/scaling.md's torchrun command with two "nodes" on 127.0.0.1, one process each: at step 3 node 1 leaves
    (its agent and worker killed) and node 0's worker dies with it; torchrun restarts node 0 alone, whose worker
    resumes last.ckpt on 1 process and reads the rest of the epoch, each sample once."""
    port, run = free_port(), tmp_path / "run"
    fit = fit_args(data, run, 1, 4, kill_at=KILLED_AT, leave_rank=1)[1:]  # the options after "fit"
    # num_nodes x devices must equal the world size, which changes between attempts: bash reads it at each start
    script = (
        'exec "$0" -m mm_lightning fit "$@" --trainer.num_nodes "$GROUP_WORLD_SIZE"'
        ' --trainer.devices "$LOCAL_WORLD_SIZE"'
    )
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "elastic-test", "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,is_host={}",
        "--no-python", "bash", "-c", script, sys.executable, *fit, "--trainer.strategy", "ddp", "--ckpt_path", "last",
    ]  # fmt: skip
    conf = torchrun.index("--rdzv-conf") + 1
    logs = [(tmp_path / f"node{n}.log").open("w") for n in (0, 1)]
    nodes = []
    for n, log in enumerate(logs):  # node 0 hosts the rendezvous store, so it outlives node 1's leaving
        command = [*torchrun[:conf], torchrun[conf].format(str(n == 0).lower()), *torchrun[conf + 1 :]]
        nodes.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log))
    try:
        nodes[0].wait(timeout=400)
        nodes[1].wait(timeout=30)
    finally:
        kill_all(nodes)
    node0 = (tmp_path / "node0.log").read_text()
    assert nodes[0].returncode == 0, node0[-5000:]
    assert nodes[1].returncode == -9  # the node that left
    assert seen_in(run, run) == Counter(range(IMAGES))
    assert last(run)["global_step"] == KILLED_AT + 6  # 24 samples left, 4 per step on one process


def epochs_seen(run: Path, killed: Path | None = None, killed_at: int = 0) -> dict[int, Counter]:
    """Samples per epoch: the killed run's before its checkpoint, then the resumed run's."""
    out: dict[int, Counter] = {}
    for folder, steps in ((killed, range(killed_at)), (run, range(killed_at, 10**6))):
        for log in sorted((folder / "samples").glob("rank*.jsonl")) if folder else []:
            for row in map(json.loads, log.read_text().splitlines()):
                if row["step"] in steps:
                    out.setdefault(row["epoch"], Counter()).update(row["index"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_epoch_ends_on_another_layout_start_the_next_epoch_once(
    data: Path, ddp_epoch: Path, tmp_path: Path
) -> None:
    epoch = Counter(range(IMAGES))
    # Killed at step 5 of 6 on 2 x 4: the 8 samples left are short of one step of 3 x 4, so epoch 0 is over and
    # epoch 1 takes 4 steps (not a second pass over epoch 0).
    killed = tmp_path / "killed"
    launch(fit_args(data, killed, 2, 4, kill_at=5, epochs=2), killed=True)
    on_three = resumed_copy(killed, tmp_path / "three")
    launch([*fit_args(data, on_three, 3, 4, epochs=2), "--ckpt_path", "last"])
    seen = epochs_seen(on_three, killed, killed_at=5)
    assert sorted(seen) == [0, 1] and seen[1] == epoch and sum(seen[0].values()) == 40 == len(seen[0])
    assert last(on_three)["global_step"] == 5 + 4

    # last.ckpt written at the epoch's end (the default callbacks'), resumed on 1 x 4: epoch 1 in 12 steps.
    ended = resumed_copy(ddp_epoch, tmp_path / "ended")
    resumed = fit_args(data, ended, 1, 4, epochs=2, every_step=False, demo_towers=True)
    assert main([*resumed, "--ckpt_path", "last"]) == 0
    seen = epochs_seen(ended)
    assert seen == {0: epoch, 1: epoch}
    assert last(ended)["global_step"] == 6 + 12


@pytest.fixture(scope="module")
def mixture(data: Path) -> dict[str, Any]:
    """The data module of a two-source mix: the 48 JSONL images once and 24 other images, as shards, twice."""
    lines = (data / "demo" / "train.jsonl").read_text().splitlines(keepends=True)[IMAGES : IMAGES + 24]
    (data / "second.jsonl").write_text("".join(lines))
    files = {"train_file": str(data / "second.jsonl"), "val_file": str(data / "val.jsonl")}
    shard = [
        "shard", "--config", str(DEMO_CONFIG),
        "--data", json.dumps({"class_path": "mm_lightning.data.MultimodalDataModule", "init_args": files}),
        "--model.image_tower.init_args.image_size", "32",
        "--out", str(data / "shards"), "--samples_per_shard", "10", "--progress", "false",
    ]  # fmt: skip
    assert main(shard) == 0
    sources = [
        {"file": str(data / "train.jsonl")},
        {"shards": str(data / "shards" / "train" / "shards.json"), "weight": 2.0},
    ]
    val = str(data / "shards" / "val" / "shards.json")
    return {
        "class_path": "mm_lightning.extras.ShardDataModule",
        "init_args": {"sources": sources, "val_shards": val},
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_source_mixture_killed_on_2_processes_resumes_on_3_and_1_with_its_exact_counts(
    data: Path, mixture: dict[str, Any], tmp_path: Path
) -> None:
    # 96 visits per epoch (mixed indices 0-47 once, 48-71 twice): 12 steps of 2 x 4; 72 left after 3 of them.
    expected = Counter({**dict.fromkeys(range(IMAGES), 1), **dict.fromkeys(range(IMAGES, IMAGES + 24), 2)})
    killed = tmp_path / "killed"
    launch(fit_args(data, killed, 2, 4, kill_at=KILLED_AT, data_module=mixture), killed=True)
    on_three = resumed_copy(killed, tmp_path / "three")
    launch([*fit_args(data, on_three, 3, 4, data_module=mixture), "--ckpt_path", "last"])
    assert seen_in(killed, on_three) == expected
    assert last(on_three)["global_step"] == KILLED_AT + 6
    on_one = resumed_copy(killed, tmp_path / "one")
    assert main([*fit_args(data, on_one, 1, 4, data_module=mixture), "--ckpt_path", "last"]) == 0
    assert seen_in(killed, on_one) == expected
    assert last(on_one)["global_step"] == KILLED_AT + 18


def modality_parallel_distances(folder: Path, ddp: dict[str, Any]) -> tuple[float, float]:
    """Parameters and AdamW exp_avg of a modality-parallel checkpoint against a DDP one."""
    ours = read_sharded_checkpoint(folder)
    assert ours["global_step"] == ddp["global_step"]
    names = [name for name, value in ddp["state_dict"].items() if value.is_floating_point()]
    weights = relative(
        torch.cat([ours["state_dict"][n].reshape(-1) for n in names]),
        torch.cat([ddp["state_dict"][n].reshape(-1) for n in names]),
    )
    prefix, suffix = "optimizer_0.state.", ".exp_avg"
    moments = {
        key[len(prefix) : -len(suffix)]: value
        for key, value in read_entries(folder, prefix).items()
        if key.endswith(suffix)
    }
    saved = ddp["optimizer_states"][0]
    gradients = relative(
        torch.cat([moments[name].reshape(-1) for name in ddp_optimizer_order(ddp, moments)]),
        torch.cat(
            [
                saved["state"][index]["exp_avg"].reshape(-1)
                for group in saved["param_groups"]
                for index in group["params"]
            ]
        ),
    )
    return weights, gradients


def ddp_optimizer_order(ddp: dict[str, Any], trained: Iterable[str]) -> list[str]:
    """The names of the parameters DDP's optimizer numbers 0, 1, ...: its groups, rebuilt from the module's
    parameter order as the module builds them (each tower, then the heads)."""
    state = ddp["state_dict"]
    params = {name: nn.Parameter(state[name]) for name in state if name in set(trained)}
    tower = lambda kind: [(n, p) for n, p in params.items() if n.startswith(f"model.{kind}_encoder.")]  # noqa: E731
    groups = param_groups(
        {
            "image_encoder": (tower("image"), 0.0),
            "text_encoder": (tower("text"), 0.0),
            "heads": (list(params.items()), 0.0),
        },
        0.0,
    )
    names = {id(p): n for n, p in params.items()}
    assert [g["name"] for g in groups] == [g["name"] for g in ddp["optimizer_states"][0]["param_groups"]]
    return [names[id(p)] for group in groups for p in group["params"]]


def rank_samples(run: Path, rank: int, steps: range) -> list[int]:
    """The sample indices one process trained on in ``steps``."""
    rows = [json.loads(line) for line in (run / "samples" / f"rank{rank}.jsonl").read_text().splitlines()]
    return [index for row in rows if row["step"] in steps for index in row["index"]]


def modality_parallel_args(data: Path, run: Path, kill_at: int | None = None) -> list[str]:
    """``fit_args`` of the demo's towers on 2 processes under configs/modality_parallel.yaml: rank 0 the image
    tower, rank 1 the text tower."""
    overlay = ["--config", str(REPO / "configs" / "modality_parallel.yaml")]
    every_third = ["--checkpoint.every_n_train_steps", "3"]
    return [*fit_args(data, run, 2, 4, kill_at=kill_at, demo_towers=True), *overlay, *every_third]


def changed_sample(data: Path, to: Path, index: int) -> Path:
    """A copy of ``data`` with sample ``index``'s caption changed."""
    to.mkdir()
    (to / "images").symlink_to(data / "images")
    shutil.copy(data / "val.jsonl", to / "val.jsonl")
    lines = (data / "train.jsonl").read_text().splitlines()
    lines[index] = json.dumps(
        {**json.loads(lines[index]), "text": ["a tiny green star on a white background"]}
    )
    (to / "train.jsonl").write_text("\n".join(lines) + "\n")
    return to


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_modality_parallel_on_the_demo_towers_equals_ddp_and_resumes_exactly(
    data: Path, ddp_epoch: Path, tmp_path: Path
) -> None:
    """configs/modality_parallel.yaml on 2 processes against DDP on the same 2 x 4 global batch, both with the
    demo's own towers: the weights and AdamW moments after 3 steps, and after a SIGKILL there and a resume, after
    the epoch's 6."""
    ddp_at = lambda step: torch.load(ddp_epoch / "checkpoints" / f"step={step}.ckpt", weights_only=True)  # noqa: E731
    killed = tmp_path / "killed"
    launch(modality_parallel_args(data, killed, kill_at=KILLED_AT), killed=True)
    folder = killed / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(folder)
    # each process wrote its own tower and its moments (the shared heads are written once, by either)
    owners = {index.fqn: info.relative_path for index, info in read_metadata(folder).storage_data.items()}
    held = Counter()
    for fqn, shard in owners.items():
        tower = re.match(r"(state_dict|optimizer_0\.state)\.model\.(image|text)_(encoder|proj)\.", fqn)
        if tower:
            assert shard == {"image": "__0_0.distcp", "text": "__1_0.distcp"}[tower[2]], fqn
            held[tower[2]] += 1
    assert held["image"] and held["text"]
    parameters, gradients = modality_parallel_distances(folder, ddp_at(KILLED_AT))
    print(f"after {KILLED_AT} steps: parameters {parameters:.1e}, gradient means {gradients:.1e}")
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE

    # Control: DDP with one sample of those steps changed ends outside both tolerances.
    changed = changed_sample(data, tmp_path / "changed", rank_samples(ddp_epoch, 1, range(KILLED_AT))[0])
    control = tmp_path / "control"
    launch([*fit_args(changed, control, 2, 4, demo_towers=True), "--trainer.max_steps", str(KILLED_AT)])
    parameters, gradients = modality_parallel_distances(folder, last(control))
    print(f"control, one sample changed: parameters {parameters:.1e}, gradients {gradients:.1e}")
    assert parameters > PARAMETER_TOLERANCE and gradients > GRADIENT_TOLERANCE

    outputs = launch([*modality_parallel_args(data, killed), "--ckpt_path", "last"])
    assert "rank 0: image tower" in outputs[0] and "rank 1: text tower" in outputs[0]
    # each group read each sample of the epoch once, both the same ones in the same steps
    epoch = range(IMAGES // 8)
    assert Counter(rank_samples(killed, 0, epoch)) == Counter(range(IMAGES))
    assert rank_samples(killed, 1, epoch) == rank_samples(killed, 0, epoch)
    parameters, gradients = modality_parallel_distances(folder, ddp_at(IMAGES // 8))
    print(
        f"after {IMAGES // 8} steps, killed and resumed: parameters {parameters:.1e}, gradients {gradients:.1e}"
    )
    assert parameters <= PARAMETER_TOLERANCE and gradients <= GRADIENT_TOLERANCE
