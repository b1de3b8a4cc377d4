"""``MultimodalModule``: dual encoders + projections, contrastive (ITC) and image-text matching (ITM) losses.

Run it through the CLI: ``python -m mm_lightning fit --config configs/demo.yaml``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from mm_lightning.embeddings import l2_normalize
from mm_lightning.metrics import first_occurrence, retrieval_metrics
from mm_lightning.models.itm import ImageTextMatching
from mm_lightning.models.losses import DynamicWeightAveraging, build_loss, complexity_weights
from mm_lightning.models.optim import clip_grouped, param_groups, warmup_cosine
from mm_lightning.models.towers import EncoderOutput, build_image_tower, build_text_tower


class MultimodalModule(LightningModule):
    """Image-text model: encoders, projections to a shared space, ITC + ITM losses, retrieval metrics.

    Args:
        image_encoder: torchvision model name, or ``resnet_custom`` / ``vit_custom`` (small CPU builds).
        image_weights: torchvision weights name, or None for random init (offline).
        image_encoder_kwargs: extra image encoder constructor arguments.
        image_size: input resolution (linked from ``data.image_size`` by the CLI).
        text_encoder: Hugging Face name or local path (``mm-lightning/demo-bert`` for the demo).
        text_pretrained: load pretrained text weights; False builds from the config (random init).
        text_config_overrides: text config fields to override (e.g. ``num_hidden_layers``).
        text_pooling: ``cls`` or masked ``mean`` pooling of the text tokens.
        trust_remote_code: allow model code from the text encoder's repository.
        embed_dim: shared embedding (and fusion) width.
        fusion_layers: cross-attention fusion layers.
        fusion_heads: fusion attention heads.
        fusion_bidirectional: add the text -> image attention direction.
        itc_weight: weight of the contrastive loss.
        itm_weight: weight of the ITM loss; 0 switches ITM (and the fusion module) off.
        loss_weighting: ``fixed`` weights, or ``dwa`` (Dynamic Weight Averaging on the losses' trend).
        dwa_window: DWA window in steps.
        dwa_temperature: DWA softmax temperature.
        sample_weighting: ``none``, or ``complexity`` (per-pair weights from image detail and caption length).
        temperature_init: initial contrastive temperature.
        learnable_temperature: train the temperature.
        global_negatives: under data parallelism, use the global batch for contrastive and ITM negatives.
        lr: learning rate of the new heads (projections, fusion, ITM head, temperature).
        lr_image_encoder: image encoder LR (default ``lr``).
        lr_text_encoder: text encoder LR (default ``lr``).
        weight_decay: AdamW weight decay (biases, norms and temperature excluded).
        warmup_steps: linear warmup steps.
        min_lr_ratio: final LR / peak LR of the cosine decay.
        clip_image_encoder: max gradient norm of the image encoder (None: no per-tower clipping).
        clip_text_encoder: max gradient norm of the text encoder.
        clip_heads: max gradient norm of the remaining parameters.
        freeze_image: freeze the image tower (kept in eval mode, LiT-style).
        freeze_text: freeze the text tower (kept in eval mode).
        gradient_checkpointing: recompute encoder activations in backward to save memory.
    """

    def __init__(
        self,
        image_encoder: str = "resnet50",
        image_weights: str | None = None,
        image_encoder_kwargs: dict | None = None,
        image_size: int = 224,
        text_encoder: str = "bert-base-uncased",
        text_pretrained: bool = True,
        text_config_overrides: dict | None = None,
        text_pooling: Literal["cls", "mean"] = "cls",
        trust_remote_code: bool = False,
        embed_dim: int = 256,
        fusion_layers: int = 1,
        fusion_heads: int = 8,
        fusion_bidirectional: bool = False,
        itc_weight: float = 1.0,
        itm_weight: float = 1.0,
        loss_weighting: Literal["fixed", "dwa"] = "fixed",
        dwa_window: int = 50,
        dwa_temperature: float = 2.0,
        sample_weighting: Literal["none", "complexity"] = "none",
        temperature_init: float = 0.07,
        learnable_temperature: bool = True,
        global_negatives: bool = True,
        lr: float = 1e-4,
        lr_image_encoder: float | None = None,
        lr_text_encoder: float | None = None,
        weight_decay: float = 0.05,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.0,
        clip_image_encoder: float | None = None,
        clip_text_encoder: float | None = None,
        clip_heads: float | None = None,
        freeze_image: bool = False,
        freeze_text: bool = False,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.image_encoder = build_image_tower(image_encoder, image_weights, image_size, image_encoder_kwargs)
        self.text_encoder = build_text_tower(
            text_encoder, text_pretrained, text_config_overrides, text_pooling, trust_remote_code
        )
        self.image_proj = nn.Linear(self.image_encoder.pooled_dim, embed_dim)
        self.text_proj = nn.Linear(self.text_encoder.pooled_dim, embed_dim)
        self.contrastive = build_loss(
            "clip",
            temperature_init=temperature_init,
            learnable_temperature=learnable_temperature,
            global_negatives=global_negatives,
        )
        # built only when used: parameters without gradient would break DDP's reducer
        self.itm = (
            ImageTextMatching(
                self.image_encoder.token_dim,
                self.text_encoder.token_dim,
                embed_dim,
                fusion_layers,
                fusion_heads,
                fusion_bidirectional,
            )
            if itm_weight > 0
            else None
        )
        base_weights = [itc_weight, itm_weight]
        self.dwa = (
            DynamicWeightAveraging(base_weights, dwa_window, dwa_temperature)
            if loss_weighting == "dwa"
            else None
        )
        self.register_buffer("fixed_weights", torch.tensor(base_weights), persistent=False)
        self.image_encoder.requires_grad_(not freeze_image)
        self.text_encoder.requires_grad_(not freeze_text)
        if gradient_checkpointing:
            self.image_encoder.set_gradient_checkpointing(True)
            self.text_encoder.set_gradient_checkpointing(True)
        self._eval_outputs: list[dict[str, Tensor]] = []
        # Lightning keeps each submodule's mode as found, so frozen towers must start in eval mode
        self.train()

    @override
    def train(self, mode: bool = True) -> MultimodalModule:
        super().train(mode)
        # frozen towers keep BatchNorm statistics and dropout off (LiT)
        if self.hparams.freeze_image:
            self.image_encoder.eval()
        if self.hparams.freeze_text:
            self.text_encoder.eval()
        return self

    def encode(self, batch: dict[str, Tensor]) -> tuple[EncoderOutput, EncoderOutput, Tensor, Tensor]:
        """Runs both towers; returns their outputs and the projected (unnormalized) embeddings."""
        image_out = self.image_encoder(batch["image"])
        text_out = self.text_encoder(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        return image_out, text_out, self.image_proj(image_out.pooled), self.text_proj(text_out.pooled)

    @torch.no_grad()
    def embed_text(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """L2-normalized fp32 embeddings of tokenized captions (inference, e.g. search queries).

        Accepts a tokenizer's output directly: ``model.embed_text(**tokenizer(texts, return_tensors="pt"))``.
        """
        out = self.text_encoder(input_ids, attention_mask, token_type_ids)
        return l2_normalize(self.text_proj(out.pooled))

    @torch.no_grad()
    def embed_images(self, images: Tensor) -> Tensor:
        """L2-normalized fp32 embeddings of (B, 3, H, W) normalized images (inference)."""
        return l2_normalize(self.image_proj(self.image_encoder(images).pooled))

    @override
    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """L2-normalized fp32 image and text embeddings of a batch."""
        _, _, image_emb, text_emb = self.encode(batch)
        return {
            "image_embeddings": l2_normalize(image_emb),
            "text_embeddings": l2_normalize(text_emb),
        }

    def _losses(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        image_out, text_out, image_emb, text_emb = self.encode(batch)
        ids = batch["image_id"]
        weights = (
            complexity_weights(batch["image"], batch["attention_mask"])
            if self.hparams.sample_weighting == "complexity"
            else None
        )
        logits = self.contrastive.logits(image_emb, text_emb, ids)
        out = {"loss_itc": self.contrastive.loss_from_logits(logits, weights)}
        if self.itm is not None:
            out["loss_itm"], out["itm_accuracy"] = self.itm(
                image_out.tokens, text_out.tokens, text_out.mask, logits, ids, weights
            )
        return out, image_emb, text_emb

    def _total(self, losses: dict[str, Tensor], weights: Tensor) -> Tensor:
        total = weights[0] * losses["loss_itc"]
        if self.itm is not None:
            total = total + weights[1] * losses["loss_itm"]
        return total

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        losses, _, _ = self._losses(batch)
        if self.dwa is not None:
            values = torch.stack(
                [losses["loss_itc"], losses.get("loss_itm", torch.zeros_like(losses["loss_itc"]))]
            )
            weights = self.dwa.update(values)
        else:
            weights = self.fixed_weights
        loss = self._total(losses, weights)
        bs = batch["image"].shape[0]
        self.log("train/loss", loss, batch_size=bs, prog_bar=True)
        for name, value in losses.items():
            self.log(f"train/{name}", value, batch_size=bs)
        self.log("train/temperature", self.contrastive.temperature, batch_size=bs)
        self.log("train/weight_itc", weights[0], batch_size=bs)
        if self.itm is not None:
            self.log("train/weight_itm", weights[1], batch_size=bs)
        return loss

    def _eval_step(self, batch: dict[str, Tensor], stage: str) -> None:
        losses, image_emb, text_emb = self._losses(batch)
        bs = batch["image"].shape[0]
        self.log(f"{stage}/loss", self._total(losses, self.fixed_weights), batch_size=bs, sync_dist=True)
        self._eval_outputs.append(
            {
                "image": l2_normalize(image_emb),
                "text": l2_normalize(text_emb),
                "image_id": batch["image_id"],
                "index": batch["index"],
            }
        )

    def _gather_eval_outputs(self) -> dict[str, Tensor]:
        """Concatenates this epoch's embeddings over batches and ranks; drops sampler padding duplicates."""
        local = {k: torch.cat([o[k] for o in self._eval_outputs]) for k in self._eval_outputs[0]}
        self._eval_outputs.clear()
        if self.trainer.world_size == 1:
            return local
        # ranks may hold different counts (uneven last batches): pad to the largest before gathering
        count = local["index"].shape[0]
        counts = self.all_gather(torch.tensor(count, device=self.device))
        longest = int(counts.max())
        padded = {k: F.pad(v, (0, 0) * (v.dim() - 1) + (0, longest - count)) for k, v in local.items()}
        gathered = self.all_gather(padded)
        rows = {
            k: torch.cat([g[r, : int(counts[r])] for r in range(g.shape[0])]) for k, g in gathered.items()
        }
        _, keep, _ = first_occurrence(rows["index"])
        return {k: v[keep] for k, v in rows.items()}

    def _log_retrieval(self, stage: str) -> None:
        if not self._eval_outputs:
            return
        outs = self._gather_eval_outputs()
        metrics = retrieval_metrics(outs["image"], outs["text"], outs["image_id"])
        # identical on every rank (computed on the gathered split), so no further sync is needed
        self.log_dict({f"{stage}/{k}": v for k, v in metrics.items()}, batch_size=outs["index"].shape[0])

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_retrieval("val")

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_retrieval("test")

    @override
    def predict_step(
        self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Tensor]:
        out = self(batch)
        return {**out, "image_id": batch["image_id"], "index": batch["index"]}

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = param_groups(
            {
                "image_encoder": (self.image_encoder, hp.lr_image_encoder or hp.lr),
                "text_encoder": (self.text_encoder, hp.lr_text_encoder or hp.lr),
                "heads": (self, hp.lr),
            },
            hp.weight_decay,
        )
        optimizer = torch.optim.AdamW(groups, lr=hp.lr)
        total = self.trainer.estimated_stepping_batches
        total_steps = int(total) if math.isfinite(total) else hp.warmup_steps
        scheduler = warmup_cosine(optimizer, hp.warmup_steps, total_steps, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        encoder_params = {id(p) for p in self.image_encoder.parameters()} | {
            id(p) for p in self.text_encoder.parameters()
        }
        hp = self.hparams
        norms = clip_grouped(
            {
                "image_encoder": (self.image_encoder.parameters(), hp.clip_image_encoder),
                "text_encoder": (self.text_encoder.parameters(), hp.clip_text_encoder),
                "heads": ([p for p in self.parameters() if id(p) not in encoder_params], hp.clip_heads),
            }
        )
        for name, norm in norms.items():
            self.log(f"train/grad_norm_{name}", norm)
        # then the trainer's global clipping (Trainer(gradient_clip_val=...)), if configured
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
