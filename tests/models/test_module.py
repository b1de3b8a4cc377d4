"""MultimodalModule on real tiny trainings: learning, logged names, checkpoints, predict files, precision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer

from mm_lightning.callbacks import EmbeddingWriter
from mm_lightning.extras import ComplexityWeighting, DynamicWeightAveraging
from mm_lightning.models import MultimodalModule
from tests.models.helpers import (
    cli_module,
    make_batch,
    module_kwargs,
    pair_loader,
    save_checkpoint,
    tiny_config,
    tiny_kwargs,
    tiny_module,
    tiny_parts,
)

TRAIN_NAMES = {"train/loss", "train/loss_itc", "train/loss_itm", "train/temperature", "train/weight_itc"}
EVAL_NAMES = {f"r{k}_{d}" for k in (1, 5, 10) for d in ("t2i", "i2t")} | {"loss", "alignment_gap"}
# the trained module of the fixture below, as plain data (its parts rebuilt to reload it)
TRAINED = tiny_config(optim={"lr": 1e-2}, text_tower={"pooling": "mean"})


def _trainer(tmp_path: Path, **kwargs: Any) -> Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return Trainer(**(defaults | kwargs))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[MultimodalModule, Trainer, dict]:
    torch.manual_seed(0)
    model = MultimodalModule(**module_kwargs(TRAINED))
    before = _trainer(Path()).validate(model, pair_loader(batch_size=16), verbose=False)[0]
    trainer = _trainer(tmp_path_factory.mktemp("fit"), max_epochs=5)
    trainer.fit(model, pair_loader(), pair_loader(batch_size=16))
    return model, trainer, before


def test_training_learns_retrieval_and_logs_contract_names(trained) -> None:
    model, trainer, before = trained
    metrics = trainer.callback_metrics
    assert TRAIN_NAMES <= set(metrics)
    assert {f"val/{n}" for n in EVAL_NAMES} <= set(metrics)
    # 8 distinct images: chance R@1 is 1/8
    assert before["val/r1_t2i"] < 0.35
    assert metrics["val/r1_t2i"] > 0.5 and metrics["val/r1_i2t"] > 0.5
    assert metrics["val/alignment_gap"] > before["val/alignment_gap"] + 0.1
    assert metrics["val/loss"] < before["val/loss"]


def test_checkpoint_reloads_offline_with_identical_outputs(trained, tmp_path: Path) -> None:
    model, trainer, _ = trained
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    # built in Python, the module's checkpoint holds no parts: they are given, newly built (random weights)
    reloaded = MultimodalModule.load_from_checkpoint(path, map_location="cpu", **tiny_parts(TRAINED))
    batch = make_batch(image_size=32)
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        a, b = model(batch), reloaded(batch)
    torch.testing.assert_close(a["image_embeddings"], b["image_embeddings"])
    torch.testing.assert_close(a["text_embeddings"], b["text_embeddings"])


def test_readme_loads_the_model_without_lightning(trained, tmp_path: Path, monkeypatch) -> None:
    """The "Use the model without Lightning" snippet of docs/models.md, run as written on a training checkpoint."""
    import re

    from tests.conftest import REPO

    model, _, _ = trained
    page = (REPO / "docs" / "models.md").read_text()
    section = page[page.index("### Use the model without Lightning") :]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "logs" / "demo" / "checkpoints").mkdir(parents=True)
    # a training run's checkpoint records its parts (the CLI built them): the same module built through the
    # CLI, holding the trained weights
    twin = cli_module(TRAINED, tmp_path / "cli")
    twin.load_state_dict(model.state_dict())
    save_checkpoint(twin, tmp_path / "logs" / "demo" / "checkpoints" / "last.ckpt")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "docs/models.md", "exec"), namespace)  # no LightningModule, no Trainer
    loaded = namespace["model"]
    assert type(loaded).__name__ == "DualEncoder" and namespace["similarity"].shape == (2, 2)
    model.eval()
    with torch.no_grad():  # the same network as the trained module's
        want = (
            model.model.embed_images(namespace["images"]) @ model.model.embed_text(**namespace["captions"]).T
        )
    torch.testing.assert_close(namespace["similarity"], want, rtol=0, atol=0)


@pytest.mark.parametrize("file_format", ["pt", "npz"])
def test_embedding_writer_writes_loadable_file(trained, tmp_path: Path, file_format: str) -> None:
    model, _, _ = trained
    writer = EmbeddingWriter(str(tmp_path / "pred"), file_format=file_format)
    _trainer(tmp_path, callbacks=[writer]).predict(
        model, pair_loader(batch_size=16), return_predictions=False
    )
    path = writer.path_for_rank(0)
    data = torch.load(path) if file_format == "pt" else dict(np.load(path))
    data = {k: torch.as_tensor(v) for k, v in data.items()}
    assert data["image_embeddings"].shape == (48, 16) and data["text_embeddings"].shape == (48, 16)
    assert data["image_embeddings"].dtype == torch.float32
    torch.testing.assert_close(data["text_embeddings"].norm(dim=1), torch.ones(48))
    assert data["index"].tolist() == list(range(48))
    assert data["image_id"].tolist() == [i % 8 for i in range(48)]
    # the README's text->image search: the best image for each caption is mostly its own
    sims = data["text_embeddings"] @ data["image_embeddings"].T
    assert (data["image_id"][sims.argmax(1)] == data["image_id"]).float().mean() > 0.5


def test_readme_text_to_image_search(trained, tmp_path: Path) -> None:
    """The README's search snippet over a predict file: a caption's top image is its own."""
    from mm_lightning.evaluation.metrics import first_occurrence

    model, _, _ = trained
    model.eval()
    writer = EmbeddingWriter(str(tmp_path))
    _trainer(tmp_path, callbacks=[writer]).predict(
        model, pair_loader(batch_size=16), return_predictions=False
    )
    emb = torch.load(writer.path_for_rank(0))
    batch = make_batch(size=1)
    dataset = pair_loader().dataset
    batch["input_ids"] = dataset.input_ids[3:4]  # a caption of image 3
    query = model.model.embed_text(batch["input_ids"], torch.ones_like(batch["input_ids"]))
    torch.testing.assert_close(query, emb["text_embeddings"][3:4])  # same as the predict path
    _, first, _ = first_occurrence(emb["image_id"])  # one row per image
    top = (emb["image_embeddings"][first] @ query.T).squeeze(1).topk(3).indices
    assert 3 in emb["image_id"][first][top].tolist()
    torch.testing.assert_close(model.model.embed_images(dataset.images[:2]), emb["image_embeddings"][:2])


def test_itm_off_builds_no_fusion_and_every_parameter_trains() -> None:
    model = tiny_module(objective={"itm_weight": 0.0})
    assert model.model.itm is None
    model.training_step(make_batch(), 0).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_every_parameter_gets_a_gradient_with_itm() -> None:
    """DDP without find_unused_parameters requires it."""
    model = tiny_module()
    model.training_step(make_batch(captions_per_image=2), 0).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_adamw_is_fused_on_cuda_parameters_or_when_asked(tmp_path: Path) -> None:
    fused = []
    for optim in ({}, {"fused": True}):
        trainer = _trainer(tmp_path, max_steps=1)
        trainer.fit(tiny_module(optim=optim), pair_loader())
        fused.append(trainer.optimizers[0].defaults["fused"])
    # null: fused only when every trainable parameter is on CUDA; CPU has a fused AdamW kernel too
    assert fused == [False, True]


def test_param_groups_lrs_and_no_weight_decay_sets(tmp_path: Path) -> None:
    model = tiny_module(
        optim={"lr": 1e-3, "weight_decay": 0.1}, image={"lr": 1e-4}, text={"lr": 5e-5, "freeze": True}
    )
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.fit(model, pair_loader())
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    assert set(groups) == {
        "image_encoder",
        "image_encoder_no_decay",
        "heads",
        "heads_no_decay",
    }  # text frozen
    assert groups["image_encoder"]["initial_lr"] == 1e-4 and groups["heads"]["initial_lr"] == 1e-3
    assert groups["heads"]["weight_decay"] == 0.1 and groups["heads_no_decay"]["weight_decay"] == 0.0
    no_decay = {id(p) for p in groups["heads_no_decay"]["params"]}
    assert id(model.model.contrastive.logit_scale) in no_decay and id(model.model.image_proj.bias) in no_decay
    assert id(model.model.image_proj.weight) not in no_decay
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert sum(len(g["params"]) for g in groups.values()) == n_trainable


def test_warmup_then_cosine_per_step(tmp_path: Path) -> None:
    lrs: list[float] = []

    class RecordLR(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    model = tiny_module(optim={"lr": 1e-3, "warmup_steps": 3, "min_lr_ratio": 0.1})
    _trainer(tmp_path, max_steps=9, callbacks=[RecordLR()]).fit(model, pair_loader(batch_size=4))
    want = [1e-3 * (s + 1) / 3 for s in range(3)]
    want += [1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (s - 3) / 6))) for s in range(3, 9)]
    np.testing.assert_allclose(lrs, want, rtol=1e-6)


def test_unbounded_run_keeps_the_peak_lr_after_warmup_and_warns(tmp_path: Path) -> None:
    lrs: list[float] = []

    class RecordAndStop(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, *args) -> None:
            trainer.should_stop = len(lrs) >= 6

    model = tiny_module(optim={"lr": 1e-3, "warmup_steps": 2})
    trainer = _trainer(tmp_path, max_epochs=-1, max_steps=-1, callbacks=[RecordAndStop()])
    with pytest.warns(UserWarning, match="unbounded.*stays at its peak"):
        trainer.fit(model, pair_loader(batch_size=4))
    np.testing.assert_allclose(lrs, [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3], rtol=1e-6)


def test_zero_tower_lr_is_a_value_not_unset(tmp_path: Path) -> None:
    model = tiny_module(optim={"lr": 1e-3}, image={"lr": 0.0})
    before = model.model.image_encoder.backbone[0][0].weight.clone()
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.fit(model, pair_loader())
    groups = {g["name"]: g for g in trainer.optimizers[0].param_groups}
    assert groups["image_encoder"]["initial_lr"] == 0.0 and groups["heads"]["initial_lr"] == 1e-3
    assert torch.equal(before, model.model.image_encoder.backbone[0][0].weight)


class ClipProbe(MultimodalModule):
    """Records the per-tower gradient norms right after clipping."""

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms = {
            name: torch.stack([p.grad.norm() for p in module.parameters() if p.grad is not None])
            .norm()
            .item()
            for name, module in (("image", self.model.image_encoder), ("text", self.model.text_encoder))
        }


def test_grouped_gradient_clipping_per_tower(tmp_path: Path) -> None:
    model = ClipProbe(**tiny_kwargs(image={"clip_norm": 1e-3}))
    _trainer(tmp_path, max_steps=1).fit(model, pair_loader())
    assert model.norms["image"] <= 1e-3 * (1 + 1e-4)
    assert model.norms["text"] > 1e-2  # not clipped
    unclipped = ClipProbe(**tiny_kwargs())
    _trainer(tmp_path, max_steps=1).fit(unclipped, pair_loader())
    assert unclipped.norms["image"] > 1e-2  # control: the image gradient is normally far larger


def test_frozen_image_tower_stays_in_eval_and_unchanged(tmp_path: Path) -> None:
    model = tiny_module(image={"freeze": True})
    before = {k: v.clone() for k, v in model.model.image_encoder.state_dict().items()}
    text_before = model.model.text_proj.weight.clone()
    _trainer(tmp_path, max_steps=3).fit(model, pair_loader())
    model.train()
    assert not model.model.image_encoder.training and model.model.text_encoder.training
    after = model.model.image_encoder.state_dict()
    assert [
        k for k in before if not torch.equal(before[k], after[k])
    ] == []  # weights and BatchNorm statistics
    assert not torch.equal(text_before, model.model.text_proj.weight)


def test_dwa_weights_are_used_and_logged(tmp_path: Path) -> None:
    model = tiny_module(objective={"itm_weight": 0.5}, term_weighting=DynamicWeightAveraging(window=2))
    trainer = _trainer(tmp_path, max_steps=6)
    trainer.fit(model, pair_loader(batch_size=8))
    dwa = model.objective.term_weighting
    assert int(dwa.windows_done) == 3
    assert dwa.factors.tolist() != [1.0, 1.0]  # adapted after two windows
    torch.testing.assert_close(trainer.callback_metrics["train/weight_itm"], 0.5 * dwa.factors[1])
    assert "objective.term_weighting.factors" in model.state_dict()  # its state is saved with the model


def test_complexity_sample_weighting_weighs_the_pairs() -> None:
    batch = make_batch()
    torch.manual_seed(0)
    weighted = tiny_module(sample_weighting=ComplexityWeighting())
    torch.manual_seed(0)
    plain = tiny_module()
    weights = weighted.objective.sample_weighting(batch)
    assert weights is not None and not torch.allclose(weights, torch.ones_like(weights))
    assert plain.objective.sample_weighting(batch) is None  # control: equal weights by default
    weighted.eval(), plain.eval()
    with torch.no_grad():
        assert not torch.allclose(weighted.training_step(batch, 0), plain.training_step(batch, 0))


def test_bf16_mixed_training_on_cpu(tmp_path: Path) -> None:
    seen: dict[str, torch.dtype] = {}
    model = tiny_module()

    def record(module, inputs, out) -> None:
        seen.setdefault("tokens", out.tokens.dtype)

    model.model.image_encoder.register_forward_hook(record)
    trainer = _trainer(tmp_path, max_steps=3, precision="bf16-mixed")
    trainer.fit(model, pair_loader())
    assert seen["tokens"] == torch.bfloat16  # encoders ran under autocast
    loss = trainer.callback_metrics["train/loss_itc"]
    assert torch.isfinite(loss) and model.model.contrastive.logit_scale.dtype == torch.float32


def test_grouped_clipping_acts_on_unscaled_gradients_under_16_mixed(tmp_path: Path) -> None:
    """With GradScaler, Lightning unscales before configure_gradient_clipping: the clipped norm is the max norm.

    Clipping the scaled gradients instead would leave the image tower at max_norm / scale after unscaling.
    """
    from lightning.pytorch.plugins import MixedPrecision

    model = ClipProbe(**tiny_kwargs(image={"clip_norm": 1e-3}))
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    _trainer(tmp_path, max_steps=1, plugins=[plugin]).fit(model, pair_loader())
    assert model.norms["image"] == pytest.approx(1e-3, rel=1e-2)
