"""EMA of the weights (``mm_lightning.extras.EMA``, Lightning's ``WeightAveraging``) from YAML: validation scores
the average (the module's epoch-end loss included), checkpoints carry both weights, a resume is bit-equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import EMAWeightAveraging
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.optim.swa_utils import get_ema_avg_fn

from mm_lightning.cli import main
from mm_lightning.extras import EMA
from tests.conftest import DEFAULT_CALLBACKS, LONG_RUN_CALLBACKS, tiny_demo_args

OURS = {"class_path": "mm_lightning.extras.EMA", "init_args": {"decay": 0.5, "warmup": False}}
STOCK = {"class_path": "lightning.pytorch.callbacks.EMAWeightAveraging", "init_args": {"decay": 0.5}}


def fit(root: Path, callbacks: list[dict], *extra: str, max_steps: int = 6) -> Path:
    """A tiny demo fit with ``callbacks`` named in a YAML overlay; returns its run dir."""
    root.mkdir(parents=True, exist_ok=True)
    overlay = root / "callbacks.yaml"
    defaults = yaml.safe_load(DEFAULT_CALLBACKS.read_text()) + yaml.safe_load(LONG_RUN_CALLBACKS.read_text())
    overlay.write_text(
        yaml.safe_dump({"trainer": {"callbacks": [*callbacks, *defaults]}})
    )  # before the defaults
    # no matching loss: its hard negatives are drawn at random, so val/loss would differ between two validations
    args = tiny_demo_args(root / "run", "--config", str(overlay), "--model.objective.itm_weight", "0", *extra,
                          max_steps=max_steps)  # fmt: skip
    assert main(["fit", *args]) == 0
    return root / "run"


def last_scalars(log_dir: Path, tags: tuple[str, ...] = ("val/loss", "val/alignment_gap")) -> list[float]:
    events = EventAccumulator(str(log_dir)).Reload()
    return [events.Scalars(tag)[-1].value for tag in tags]


def validate(run: Path, checkpoint: Path, out: Path) -> list[float]:
    """``validate`` of ``checkpoint``'s ``state_dict`` with the run's config (its EMA callback left out)."""
    args = ["--config", str(run / "version_0" / "config.yaml"), "--ckpt_path", str(checkpoint)]
    assert main(["validate", *args, "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(out)]) == 0
    return last_scalars(out / "version_0")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("callback", [OURS, STOCK], ids=["ema", "control-stock-saves-the-average-twice"])
def test_validation_scores_the_average_and_checkpoints_hold_both(tmp_path: Path, callback: dict) -> None:
    run = fit(tmp_path, [callback])
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    average, trained = checkpoint["state_dict"], checkpoint["current_model_state"]
    logged = last_scalars(run / "version_0")  # the validation at the last step, the one last.ckpt follows
    scored_average = validate(run, run / "checkpoints" / "last.ckpt", tmp_path / "average")
    assert scored_average[1] == pytest.approx(logged[1], abs=1e-6)  # both scored the average's embeddings
    if callback is STOCK:  # it copies the average over the weights before the last save: the weights are lost
        assert all(torch.equal(average[k], trained[k]) for k in average)
        return
    assert scored_average[0] == pytest.approx(logged[0], abs=1e-6)
    assert max((average[k] - trained[k]).abs().max().item() for k in average) > 1e-3
    checkpoint["state_dict"] = trained
    torch.save(checkpoint, tmp_path / "trained.ckpt")
    scored_trained = validate(run, tmp_path / "trained.ckpt", tmp_path / "trained")
    assert all(abs(t - a) > 1e-6 for t, a in zip(scored_trained, logged, strict=True))


@pytest.mark.timeout(300)
def test_resume_with_ema_is_bit_equal(tmp_path: Path) -> None:
    def kept(folder: Path) -> dict:
        return {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": str(folder),
                "filename": "{step}",
                "every_n_train_steps": 4,
                "save_top_k": -1,
            },
        }

    full = fit(tmp_path / "full", [OURS, kept(tmp_path / "kept")], max_steps=8)
    step4 = tmp_path / "kept" / "step=4.ckpt"
    resumed = fit(tmp_path / "resumed", [OURS], "--ckpt_path", str(step4), max_steps=8)
    expected = torch.load(full / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    for key in ("state_dict", "current_model_state", "averaging_state"):
        assert all(torch.equal(got[key][k], expected[key][k]) for k in expected[key]), key

    # Control: the same resume without the checkpoint's average starts it again from the weights, and it shows.
    checkpoint = torch.load(step4, weights_only=True)
    checkpoint["state_dict"] = checkpoint.pop("current_model_state")
    del checkpoint["averaging_state"]
    torch.save(checkpoint, tmp_path / "no_average.ckpt")
    control = fit(tmp_path / "control", [OURS], "--ckpt_path", str(tmp_path / "no_average.ckpt"), max_steps=8)
    other = torch.load(control / "checkpoints" / "last.ckpt", weights_only=True)
    trained = expected["current_model_state"]
    assert all(
        torch.equal(other["current_model_state"][k], trained[k]) for k in trained
    )  # training is the same
    assert not all(
        torch.equal(other["state_dict"][k], expected["state_dict"][k]) for k in expected["state_dict"]
    )


class Line(pl.LightningModule):
    """One trained and one frozen weight."""

    def __init__(self, mid_validation: Path) -> None:
        super().__init__()
        self.trained = torch.nn.Linear(4, 1)
        self.frozen = torch.nn.Linear(4, 1).requires_grad_(False)
        self.mid_validation = mid_validation

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.trained(batch[0]) + self.frozen(batch[0])).pow(2).mean()

    def on_validation_epoch_end(self) -> None:
        self.weight_at_epoch_end = self.trained.weight.detach().clone()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.mid_validation.exists():  # what a signal's save at this point writes
            self.trainer.save_checkpoint(self.mid_validation)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.trained.parameters(), lr=0.1)


def fit_line(tmp_path: Path, ema: pl.Callback) -> Line:
    torch.manual_seed(0)  # weights whose EMA drift the control below sees (not every value rounds away)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    module = Line(tmp_path / "mid_validation.ckpt")
    module.initial_frozen = module.frozen.weight.detach().clone()
    trainer = pl.Trainer(max_steps=8, val_check_interval=8, callbacks=[ema], logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, loader, loader)  # validates once, after the last step
    return module


def test_frozen_weights_stay_exact_and_a_save_mid_validation_keeps_the_average_in_state_dict(
    tmp_path: Path,
) -> None:
    module = fit_line(tmp_path, EMA(decay=0.9))
    average = module.trained.weight  # after fit the module holds the average
    frozen = module.initial_frozen
    assert torch.equal(module.frozen.weight, frozen)  # lerp towards an unchanged value is exact
    drifted = frozen.clone()
    for _ in range(8):
        drifted = get_ema_avg_fn(0.9)(drifted, frozen, None)
    assert not torch.equal(drifted, frozen)  # control: torch's EMA formula moves it

    assert torch.equal(module.weight_at_epoch_end, average)  # the module's own epoch end saw the average
    saved = torch.load(tmp_path / "mid_validation.ckpt", weights_only=True)
    assert torch.equal(saved["state_dict"]["trained.weight"], average)
    assert not torch.equal(saved["current_model_state"]["trained.weight"], average)


def test_control_lightnings_ema_swaps_back_before_the_modules_epoch_end(tmp_path: Path) -> None:
    module = fit_line(tmp_path, EMAWeightAveraging(decay=0.9))
    assert not torch.equal(module.weight_at_epoch_end, module.trained.weight)
    saved = torch.load(tmp_path / "mid_validation.ckpt", weights_only=True)
    assert not torch.equal(saved["state_dict"]["trained.weight"], module.trained.weight)  # the two swapped


def test_warmup_agrees_with_timm() -> None:
    from timm.utils import ModelEmaV3

    ema, timm_ema = EMA(decay=0.999), ModelEmaV3(torch.nn.Linear(1, 1), decay=0.999, use_warmup=True)
    # timm counts the update being made (its first copies); AveragedModel counts the updates before it
    assert [ema.decay_at(n) for n in range(3000)] == pytest.approx(
        [timm_ema.get_decay(n + 1) for n in range(3000)]
    )
    assert ema.decay_at(10) < 0.8 and ema.decay_at(10**6) == 0.999
    assert EMA(decay=0.9, warmup=False).decay_at(0) == 0.9
    with pytest.raises(ValueError, match="decay must be in"):
        EMA(decay=1.0)
