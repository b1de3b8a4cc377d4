"""Monitors: the TensorBoard tags of a real CLI run, data-wait fraction, grad norms, the retrieval grid."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from mm_lightning.extras import GradNormMonitor, RetrievalGridLogger, StepTimeMonitor
from tests.resilience.helpers import TinyModule, random_loader


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, tag: str) -> list[float]:
        return [m[tag] for _, m in self.records if tag in m]


def test_cli_run_writes_every_resilience_tag(tiny_run: Any) -> None:
    events = EventAccumulator(str(tiny_run.log_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in (
        "train/data_wait_fraction",
        "train/peak_memory_mb",
        "train/skipped_steps",
    ):
        assert tag in scalars, tag
    for tower in ("image_encoder", "text_encoder", "total"):
        assert f"grad_norm/{tower}" in scalars
    assert all(0 <= e.value <= 1 for e in events.Scalars("train/data_wait_fraction"))
    assert all(e.value > 50 for e in events.Scalars("train/peak_memory_mb"))  # a torch process RSS, in MiB
    assert all(e.value == 0 for e in events.Scalars("train/skipped_steps"))
    grid = events.Images("val/retrieval_grid")[-1]
    image = Image.open(io.BytesIO(grid.encoded_image_string))
    assert image.width == 8 * 128 and image.height > 128  # 8 tiles of 128 px with two captions under each


class SlowDataset(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.x = torch.randn(64, 8)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.x[i], self.x[i].sum()


class SlowStep(Callback):
    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        time.sleep(0.04)


@pytest.mark.parametrize(
    ("delay", "low", "high"), [(0.01, 0.35, 0.85), (0.0, 0.0, 0.2)], ids=["slow-data", "control"]
)
def test_data_wait_fraction_follows_loader_time(delay: float, low: float, high: float) -> None:
    # 4 samples x 10 ms of loading against 40 ms of step: about half of each step waits for data.
    logger = MemoryLogger()
    trainer = Trainer(
        accelerator="cpu", max_steps=12, log_every_n_steps=4, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SlowStep(), StepTimeMonitor()],
    )  # fmt: skip
    trainer.fit(TinyModule(), DataLoader(SlowDataset(delay), batch_size=4))
    fractions = logger.values("train/data_wait_fraction")
    assert len(fractions) == 3 and all(low < f < high for f in fractions), fractions
    assert logger.values("train/steps_per_sec") == []  # one owner: the ThroughputLogger


class GradCapture(Callback):
    """Records each submodule's gradient norm computed independently (flattened, one vector norm)."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.norms.append(
            {
                name: torch.cat([p.grad.flatten() for p in child.parameters()]).norm().item()
                for name, child in pl_module.named_children()
            }
        )


def test_grad_norms_per_submodule() -> None:
    logger, capture = MemoryLogger(), GradCapture()
    trainer = Trainer(
        accelerator="cpu", max_steps=6, log_every_n_steps=2, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[GradNormMonitor(), capture],
    )  # fmt: skip
    trainer.fit(TinyModule(), random_loader())
    logged = [(step, m) for step, m in logger.records if "grad_norm/total" in m]
    assert [step for step, _ in logged] == [0, 2, 4]
    for step, metrics in logged:
        expected = capture.norms[step]
        for name in ("image_encoder", "text_encoder", "head"):
            assert metrics[f"grad_norm/{name}"] == pytest.approx(expected[name], rel=1e-5)
        total = sum(v**2 for v in expected.values()) ** 0.5
        assert metrics["grad_norm/total"] == pytest.approx(total, rel=1e-5)


class _Tokenizer:
    def batch_decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> list[str]:
        return [f"caption {int(row[0])}" for row in ids]


def test_retrieval_grid_colours_correct_and_wrong_retrievals() -> None:
    grid = RetrievalGridLogger(num_images=2, tile=64)
    # Image 0's embedding matches its own caption; image 1's matches image 0's caption.
    grid._rows = [
        {
            "image": torch.rand(2, 3, 16, 16),
            "image_id": torch.tensor([10, 11]),
            "image_embeddings": torch.tensor([[1.0, 0.0], [1.0, 0.0]]),
            "text_embeddings": torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        }
    ]
    grid._captions = ["caption 0", "caption 1"]
    pixels = grid.render(trainer=None).permute(1, 2, 0)  # (H, W, 3)
    assert pixels.shape[1] == 2 * 64
    captions = pixels[64:]  # the text area under the tiles
    green = (captions[..., 1] > 100) & (captions[..., 0] < 50)
    red = (captions[..., 0] > 200) & (captions[..., 1] < 50)
    assert green[:, :64].any() and not red[:, :64].any()  # image 0: retrieved its own caption
    assert red[:, 64:].any() and not green[:, 64:].any()  # image 1: retrieved image 0's caption


def test_retrieval_grid_accepts_batches_padded_to_different_lengths() -> None:
    # Each validation batch is padded to its own longest caption: the ids of two batches have different widths.
    grid = RetrievalGridLogger(num_images=2, tile=32)
    grid._tokenizer = _Tokenizer()
    trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True)
    for batch_idx, (width, image_id) in enumerate([(3, 0), (7, 1)]):
        batch = {
            "image": torch.rand(1, 3, 8, 8),
            "input_ids": torch.full((1, width), image_id),
            "image_id": torch.tensor([image_id]),
        }
        # what validation_step returns: the batch's normalized embeddings (no second forward pass)
        outputs = {
            "image_embeddings": torch.eye(2)[image_id : image_id + 1],
            "text_embeddings": torch.eye(2)[image_id : image_id + 1],
        }
        grid.on_validation_batch_end(trainer, None, outputs, batch, batch_idx)
    assert grid._captions == ["caption 0", "caption 1"]
    assert grid.render(trainer).shape[0] == 3


def test_retrieval_grid_never_runs_the_model() -> None:
    # Control for the contract: without embeddings in the outputs the grid stays empty instead of calling forward.
    grid = RetrievalGridLogger(num_images=2, tile=32)
    trainer = SimpleNamespace(sanity_checking=False, is_global_zero=True)

    class Forbidden:
        def __call__(self, *args: Any) -> None:
            raise AssertionError("the grid must not run a forward pass")

    batch = {"image": torch.rand(1, 3, 8, 8), "input_ids": torch.ones(1, 3), "image_id": torch.tensor([0])}
    with pytest.warns(UserWarning, match="validation_step returns no dict"):
        grid.on_validation_batch_end(trainer, Forbidden(), None, batch, 0)
    assert grid._rows == []
