"""What modality parallelism cannot reproduce is refused at fit start in one line, before any process trains."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

from mm_lightning.extras import GradientCaching
from mm_lightning.extras.modality_parallel import ModalityParallel, ModalityParallelError
from mm_lightning.models.losses.objective import SampleWeighting
from mm_lightning.models.rules import WholeBatch


class PerPairWeights(SampleWeighting):
    """A weighting that reads the batch's rows (any subclass does)."""


def module(
    image_tower: nn.Module | None = None, text_proj: nn.Module | None = None, **changes: Any
) -> SimpleNamespace:
    """What the check reads of a module: the defaults of a plain run, with ``changes``."""
    towers = SimpleNamespace(
        image_encoder=image_tower or nn.Linear(2, 2),
        text_encoder=nn.Linear(2, 2),
        image_proj=nn.Linear(2, 2),
        text_proj=text_proj or nn.Linear(2, 2),
    )
    parts = {
        "batch_embedding": WholeBatch(),
        "objective": SimpleNamespace(sample_weighting=SampleWeighting()),
        "optim_config": SimpleNamespace(clip_heads=None),
        "hparams": {"gradient_checkpointing": False},
    }
    return SimpleNamespace(model=towers, **{**parts, **changes})


def trainer(**changes: Any) -> SimpleNamespace:
    return SimpleNamespace(**{"gradient_clip_val": None, "callbacks": [], "datamodule": None, **changes})


def batchnorm_tower(training: bool = True) -> nn.Module:
    tower = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    tower[1].train(training)
    return tower


@pytest.mark.parametrize(
    ("module_", "trainer_", "named"),
    [
        (module(batch_embedding=GradientCaching(chunks=2)), trainer(), "GradientCaching cannot run"),
        (module(objective=SimpleNamespace(sample_weighting=PerPairWeights())), trainer(), "sample_weighting"),
        (module(), trainer(gradient_clip_val=1.0), "clip per tower"),
        (module(nn.Sequential(nn.SyncBatchNorm(4))), trainer(), "SyncBatchNorm"),
        (module(text_proj=nn.SyncBatchNorm(2)), trainer(), "SyncBatchNorm"),
        (
            module(batchnorm_tower(), hparams={"gradient_checkpointing": True}),
            trainer(),
            "gradient checkpointing",
        ),
    ],
    ids=[
        "gradient-caching",
        "sample-weighting",
        "clip-all",
        "sync-batchnorm",
        "sync-batchnorm-projection",
        "checkpointing-batchnorm",
    ],
)
def test_a_run_it_cannot_reproduce_is_refused_in_one_line(
    module_: SimpleNamespace, trainer_: SimpleNamespace, named: str
) -> None:
    with pytest.raises(ModalityParallelError, match=named) as refused:
        ModalityParallel().check_training(module_, trainer_)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


def test_what_it_reproduces_passes() -> None:
    strategy = ModalityParallel()
    strategy.check_training(module(batchnorm_tower()), trainer())  # type: ignore[arg-type]
    # control for the last refusal: with BatchNorm's statistics frozen, gradient checkpointing is fine
    frozen = module(batchnorm_tower(training=False), hparams={"gradient_checkpointing": True})
    strategy.check_training(frozen, trainer())  # type: ignore[arg-type]
