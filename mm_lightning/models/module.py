"""``MultimodalModule``: LightningModule training a :class:`~mm_lightning.models.DualEncoder` (``.model``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import is_dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from typing_extensions import override

from mm_lightning.data.records import STAND_IN_KEY
from mm_lightning.data.resume import planned_steps, rescale_for_global_batch
from mm_lightning.evaluation.rerank import Reranker
from mm_lightning.logging_steps import ends_epoch_or_run, loggers_write_this_step
from mm_lightning.models.config import (
    DEFAULT_FUSION,
    DEFAULT_OBJECTIVE,
    DEFAULT_OPTIM,
    DEFAULT_TRAINING,
    PARTS,
    FusionConfig,
    ObjectiveConfig,
    OptimConfig,
    TowerTraining,
)
from mm_lightning.models.draws import batch_draws, seed_part
from mm_lightning.models.dual_encoder import DualEncoder
from mm_lightning.models.losses.objective import BatchLoss, Objective, SampleWeighting, TermWeighting
from mm_lightning.models.optim import clip_gradients, optimizer_and_schedule
from mm_lightning.models.rules import RULES, ParamGroupRule, TowerAdapters, WholeBatch
from mm_lightning.option_groups import as_config, as_record


class MultimodalModule(LightningModule):
    """Trains a :class:`~mm_lightning.models.DualEncoder`: ITC (+ ITM) losses, retrieval metrics, AdamW.

    Option groups take a dataclass or a dict (missing keys keep defaults). Built in Python, it records no
    parts: pass them to ``load_from_checkpoint``.

    Args:
        image_tower: image tower (:mod:`mm_lightning.models.towers`, or yours under the tower contract).
        text_tower: text tower (same); the data's tokenizer follows it.
        loss: pair loss (:mod:`mm_lightning.models.losses`; ``ContrastiveLoss()`` when None).
        image: how the image tower trains (:class:`~mm_lightning.models.config.TowerTraining`).
        text: how the text tower trains.
        embed_dim: shared embedding (and fusion) width.
        fusion: cross-attention fusion of the ITM head (:class:`~mm_lightning.models.config.FusionConfig`).
        objective: how loss terms are weighted (:class:`~mm_lightning.models.config.ObjectiveConfig`).
        optim: optimizer and schedule (:class:`~mm_lightning.models.config.OptimConfig`).
        batch_embedding: how a training batch is embedded (a :class:`~mm_lightning.models.rules.WholeBatch`
            named by ``class_path``; none: one forward of each tower).
        param_groups: learning-rate groups ahead of the whole towers (a :class:`~mm_lightning.models.rules.ParamGroupRule`
            named by ``class_path``; none: each tower one group).
        term_weighting: each step's weights of the loss terms (a :class:`~mm_lightning.models.losses.objective.TermWeighting`;
            none: ``objective``'s fixed weights).
        sample_weighting: per-pair loss weights (a :class:`~mm_lightning.models.losses.objective.SampleWeighting`; none:
            equal weights).
        adapters: what trains in the towers' place (a :class:`~mm_lightning.models.rules.TowerAdapters`, e.g.
            LoRA; none: the towers themselves).
        reranker: validation and test also rank each query's top k re-scored by the matching head
            (:class:`~mm_lightning.evaluation.rerank.Reranker`, ``init_args: {k: 16}``; none: cosine ranks only).
        gradient_checkpointing: recompute tower activations in backward to save memory.
        compile: ``torch.compile`` the towers (true), or options to compile them with (``{"mode": ...}``)."""

    def __init__(
        self,
        image_tower: nn.Module,
        text_tower: nn.Module,
        loss: nn.Module | None = None,
        image: TowerTraining = DEFAULT_TRAINING,
        text: TowerTraining = DEFAULT_TRAINING,
        embed_dim: int = 256,
        fusion: FusionConfig = DEFAULT_FUSION,
        objective: ObjectiveConfig = DEFAULT_OBJECTIVE,
        optim: OptimConfig = DEFAULT_OPTIM,
        batch_embedding: WholeBatch | None = None,
        param_groups: ParamGroupRule | None = None,
        term_weighting: TermWeighting | None = None,
        sample_weighting: SampleWeighting | None = None,
        adapters: TowerAdapters | None = None,
        reranker: Reranker | None = None,
        gradient_checkpointing: bool = False,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        # the CLI records parts and rules as class_path + init_args; built in Python, parts are left out
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is an instance of `nn.Module`")
            self.save_hyperparameters()
        built = [name for name in PARTS if not isinstance(self.hparams.get(name), (Mapping, type(None)))]
        if built:  # towers and losses built in Python: their weights are saved, pass them again to load
            self.save_hyperparameters(ignore=built)
        recorded = {
            name: rule.record() for name in RULES if hasattr(rule := self.hparams.get(name), "record")
        }
        if recorded:  # rules built in Python: recorded as a config names them (for the loggers too)
            self.save_hyperparameters({**self.hparams, **recorded})
        rules = dict(zip(RULES, (param_groups, batch_embedding, term_weighting, sample_weighting, adapters, reranker),
                         strict=True))  # fmt: skip
        if any(
            isinstance(rule, Mapping) for rule in rules.values()
        ):  # records, as a checked load passes them
            from mm_lightning.checkpoints.loading import built_rule

            rules = {name: built_rule(name, r) if isinstance(r, Mapping) else r for name, r in rules.items()}
        param_groups, batch_embedding, term_weighting, sample_weighting, adapters, reranker = (
            rules[name] for name in RULES
        )
        self.param_group_rule = param_groups or ParamGroupRule()
        self.image_config = as_config(TowerTraining, image, "model.image")
        self.text_config = as_config(TowerTraining, text, "model.text")
        self.objective_config = oc = as_config(ObjectiveConfig, objective, "model.objective")
        self.optim_config = as_config(OptimConfig, optim, "model.optim")
        self.model = DualEncoder(
            image_tower,
            text_tower,
            loss,
            self.image_config,
            self.text_config,
            embed_dim,
            as_config(FusionConfig, fusion, "model.fusion"),
            itm=oc.itm_weight > 0,
            adapters=adapters,
        )
        if gradient_checkpointing:
            self.model.set_gradient_checkpointing(True)
        self.objective = Objective(oc, term_weighting, sample_weighting)
        self.batch_embedding = batch_embedding or WholeBatch()
        self._towers_compiled = False
        self.reranker = reranker
        self.evaluation = None
        self.flops_per_batch: int | None = None  # set by the FlopCounter callback, for ThroughputLogger

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> MultimodalModule:  # type: ignore[override]
        """Lightning's, once what the checkpoint records is checked (:mod:`mm_lightning.checkpoints.loading`)."""
        from mm_lightning.checkpoints.loading import checked_for_loading

        checked = checked_for_loading(cls, checkpoint_path, *args, **kwargs)
        return super().load_from_checkpoint(checked, *args, **kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Built in Python, the option groups may be dataclasses: plain dicts load with weights_only=True.
        hparams = checkpoint.get("hyper_parameters", {})
        for name, value in list(hparams.items()):
            if is_dataclass(value) and not isinstance(value, type):
                hparams[name] = as_record(value)

    @property
    def data_config(self) -> dict[str, dict[str, Any]]:
        """Preprocessing the towers expect (:attr:`DualEncoder.data_config`), for the data side to follow."""
        return self.model.data_config

    @override
    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """L2-normalized fp32 image and text embeddings of a batch (one row per pair)."""
        return self.model(batch)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        with batch_draws(self.running_trainer(), self.device):
            embedded = self.batch_embedding.embed(self.model, batch)
            rows = self.batch_embedding.loss_rows(batch)
            seed_part("loss")
            loss = self.objective(self.model, rows, embedded)
        self.log_training(loss, batch_size=rows["image_id"].shape[0])
        return loss.total

    def log_training(self, loss: BatchLoss, batch_size: int) -> None:
        """``train/loss`` at every step; its terms, the temperature and the weights only on the steps the loggers
        write (and at an epoch's or the run's end). Not on the progress bar: it reads its values back from the
        device at every step."""
        self.log("train/loss", loss.total, batch_size=batch_size)
        if not self._logs_details_now():
            return
        for name, value in loss.terms.items():
            self.log(f"train/loss_{name}", value, batch_size=batch_size)
        for name, value in loss.metrics.items():
            self.log(f"train/{name}", value, batch_size=batch_size)
        temperature = getattr(self.model.contrastive, "temperature", None)
        if isinstance(temperature, (Tensor, float)):
            self.log("train/temperature", temperature, batch_size=batch_size)
        self.log("train/weight_itc", loss.weights["itc"], batch_size=batch_size)
        if self.model.itm is not None:
            self.log("train/weight_itm", loss.weights["itm"], batch_size=batch_size)

    def _logs_details_now(self) -> bool:
        """Whether to log terms, temperature and weights: only when loggers write or an epoch/run ends."""
        trainer = self.running_trainer()
        return trainer is None or loggers_write_this_step(trainer) or ends_epoch_or_run(trainer)

    def running_trainer(self) -> Trainer | None:
        """The trainer running this module, or ``None`` (a plain loop calling ``training_step``)."""
        try:
            return self.trainer
        except RuntimeError:  # "not attached to a Trainer"
            return None

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        # gradient caching runs its own backward (loss carries GradScaler's scale and accumulation divisor)
        if not self.batch_embedding.backward(loss):
            super().backward(loss, *args, **kwargs)

    @override
    def on_train_start(self) -> None:
        rescale_for_global_batch(self.trainer, self.optim_config.lr_scaling)
        self.batch_embedding.check_wrapper(self.trainer.strategy.model)

    @override
    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.batch_embedding.setup(self.trainer.strategy, self.model)

    @override
    def configure_model(self) -> None:
        # here (once per process, after the strategy is set up) and in place, so checkpoint keys do not change
        if self.hparams.compile and not self._towers_compiled:
            self.compile_towers()

    def compile_towers(self) -> None:
        """Compiles both towers in place with ``torch.compile`` (what ``compile=True`` does at fit start)."""
        self.model.compile_towers(self.hparams.compile if isinstance(self.hparams.compile, dict) else {})
        self._towers_compiled = True

    def _evaluation(self) -> Any:
        if self.evaluation is None:  # the evaluation code loads only when a run evaluates
            from mm_lightning.evaluation.validation import Evaluation

            self.evaluation = Evaluation.of(self)
        return self.evaluation

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._evaluation().step(self, batch, "val")

    @override
    def on_validation_epoch_start(self) -> None:
        self._evaluation().start_epoch()

    @override
    def on_validation_epoch_end(self) -> None:
        self._evaluation().end_epoch(self, "val")

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._evaluation().step(self, batch, "test")

    @override
    def on_test_epoch_start(self) -> None:
        self._evaluation().start_epoch()

    @override
    def on_test_epoch_end(self) -> None:
        self._evaluation().end_epoch(self, "test")

    @override
    def predict_step(
        self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        out = self(batch)
        stand_in = batch.get(STAND_IN_KEY)
        if stand_in is None:
            stand_in = torch.zeros_like(batch["index"], dtype=torch.bool)
        return {**out, "image_id": batch["image_id"], "index": batch["index"], "stand_in": stand_in}

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        rates = {
            kind: (
                getattr(self.model, f"{kind}_encoder"),
                self.optim_config.lr if config.lr is None else config.lr,
            )
            for kind, config in (("image", self.image_config), ("text", self.text_config))
        }
        # the rule's groups first: a parameter joins its first group
        towers: dict[str, tuple[Any, float | None]] = dict(self.param_group_rule.groups(rates))
        towers["image_encoder"] = (self.model.image_encoder, self.image_config.lr)
        towers["text_encoder"] = (self.model.text_encoder, self.text_config.lr)
        trainer = self.trainer
        return optimizer_and_schedule(self, towers, self.optim_config, lambda: planned_steps(trainer))

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        towers = {
            "image_encoder": (self.model.image_encoder, self.image_config.clip_norm),
            "text_encoder": (self.model.text_encoder, self.text_config.clip_norm),
        }
        clip_gradients(
            self, optimizer, towers, self.optim_config.clip_heads, gradient_clip_val, gradient_clip_algorithm
        )
