"""A training step never waits for the device: no host sync (``.item()``, boolean indexing, ``nonzero``, ...) in
real steps of the demo and the LiT recipe, their callbacks included, except on the steps that log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_lightning.cli import cli_main
from mm_lightning.extras import NaNGuard
from tests.conftest import REPO, small_demo_args
from tests.host_syncs import StepSyncs, host_syncs

LOG_EVERY = 4
STEPS = 7  # steps 3 and 6 log (every 4th, and the run's last)


def _step_syncs(root: Path, args: list[str], defer: bool = True) -> dict[int, list[tuple[str, str]]]:
    """Each step's host syncs in a fit as it runs on a GPU: a fused optimizer, the NaN guard deciding there
    (``defer``; a CPU sync costs nothing, so on a CPU it decides on the host)."""
    run = [
        *args,
        "--trainer.max_steps", str(STEPS),
        "--trainer.log_every_n_steps", str(LOG_EVERY),
        "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(root),
        "--trainer.callbacks+=tests.host_syncs.StepSyncs",
        "--model.optim.fused", "true",
    ]  # fmt: skip
    cli = cli_main(run, run=False)
    for callback in cli.trainer.callbacks:
        if isinstance(callback, NaNGuard):
            callback.defer = defer
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (recorder,) = [c for c in cli.trainer.callbacks if isinstance(c, StepSyncs)]
    assert sorted(recorder.steps) == list(range(STEPS))
    # torch.optim reads its step counters, which live on the CPU on any device, and the schedulers their values
    # there: reads of host tensors, not of the device.
    return {
        step: [r for r in records if "/torch/optim/" not in r[1]] for step, records in recorder.steps.items()
    }


def _quiet_steps(syncs: dict[int, list]) -> dict[int, list]:
    """The steps that do not log: neither every ``LOG_EVERY``-th nor the last."""
    return {s: r for s, r in syncs.items() if (s + 1) % LOG_EVERY and s != STEPS - 1}


CLIPPING = [
    "--trainer.gradient_clip_val",
    "1.0",
    "--model.image.clip_norm",
    "0.5",
    "--model.optim.clip_heads",
    "2.0",
]


@pytest.mark.parametrize("options", [[], CLIPPING], ids=["as_shipped", "clipping"])
def test_demo_steps_never_wait_for_the_device(tmp_path: Path, options: list[str]) -> None:
    # the demo as shipped (its callbacks, its data worker), and with every gradient clipping it offers
    syncs = _step_syncs(tmp_path, [*small_demo_args(tmp_path), *options])
    assert _quiet_steps(syncs) == {s: [] for s in _quiet_steps(syncs)}
    assert any(syncs[s] for s in (3, 6))  # control: the logging steps read values back, and are seen


@pytest.mark.parametrize("on_device", [True, False])
def test_lit_steps_never_wait_for_the_device(tmp_path: Path, on_device: bool) -> None:
    # the recipe's callbacks (its feature cache, the long-run ones), the demo's data, the demo's tiny text tower
    args = [
        "--config", str(REPO / "configs" / "lit.yaml"),
        "--config", str(REPO / "configs" / "demo_data.yaml"),
        *small_demo_args(tmp_path)[2:],
        "--model.text_tower.init_args.name", "mm-lightning/demo-bert",
        "--model.text_tower.init_args.pretrained", "false",
        "--data.init_args.images.size", "64",
        "--data.init_args.render_size", "64",
        "--data.init_args.batch_size", "16",
    ]  # fmt: skip
    syncs = _step_syncs(tmp_path, args, defer=on_device)
    quiet = _quiet_steps(syncs)
    if on_device:
        assert quiet == {s: [] for s in quiet}
    else:  # control: the NaN guard deciding on the host reads its flags back at every step
        assert all(any("nan_guard.py" in where for _, where in quiet[s]) for s in quiet)


def test_the_counter_sees_a_sync_in_a_training_step() -> None:
    # control: one boolean-mask read in an otherwise clean step is counted, with its line
    weights = torch.randn(8, requires_grad=True)
    with host_syncs() as syncs:
        loss = (weights * torch.randn(8)).sum()
        loss.backward()
    assert syncs.records == []
    with host_syncs() as syncs:
        kept = weights[weights > 0]  # boolean indexing sizes its output by the data
        kept.sum().backward()
    op, where = syncs.records[0]  # the forward's read (its backward scatters through the same mask)
    assert op == "aten.index.Tensor" and "test_host_syncs.py" in where
