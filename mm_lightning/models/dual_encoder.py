"""``DualEncoder``: the image-text network (towers, projections, loss, ITM head) as a plain ``nn.Module``::

model = DualEncoder.from_checkpoint("logs/demo/checkpoints/last.ckpt").eval()
scores = model.embed_images(images) @ model.embed_text(**tokenizer(captions, padding=True, return_tensors="pt")).T
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from mm_lightning.evaluation.metrics import l2_normalize
from mm_lightning.models.config import (
    DEFAULT_FUSION,
    DEFAULT_TRAINING,
    FusionConfig,
    TowerTraining,
)
from mm_lightning.models.itm import ImageTextMatching
from mm_lightning.models.losses import ContrastiveLoss, SigLipLoss, loss_terms
from mm_lightning.models.losses.checks import check_loss
from mm_lightning.models.rules import TowerAdapters
from mm_lightning.models.towers.contract import (
    EncoderOutput,
    Tower,
    as_encoder_output,
    batchnorm_layers,
    call_text_tower,
    data_config_of,
    keep_locked_layers_in_eval,
    projection_for,
    set_gradient_checkpointing,
    take_over_logit_scale,
    takes_token_type_ids,
    train_last_groups,
)
from mm_lightning.option_groups import as_config

BUILT_IN_LOSSES = (ContrastiveLoss, SigLipLoss)


class DualEncoder(nn.Module):
    """Image and text towers, projections, the pair loss (and its temperature), the ITM fusion and head.

    Args:
        image_tower: the image tower (built-in, or any module under the tower contract).
        text_tower: the text tower (same).
        loss: the pair loss (:class:`~mm_lightning.models.losses.ContrastiveLoss` with its defaults when None).
        image: how the image tower trains (:class:`~mm_lightning.models.config.TowerTraining` or a dict).
        text: how the text tower trains.
        embed_dim: shared embedding (and fusion) width.
        fusion: the cross-attention fusion of the ITM head (:class:`~mm_lightning.models.config.FusionConfig`).
        itm: build the fusion and the image-text matching head.
        adapters: what trains in the towers' place (a :class:`~mm_lightning.models.rules.TowerAdapters`; none: the
            towers themselves).
    """

    def __init__(
        self,
        image_tower: nn.Module,
        text_tower: nn.Module,
        loss: nn.Module | None = None,
        image: TowerTraining | dict[str, Any] = DEFAULT_TRAINING,
        text: TowerTraining | dict[str, Any] = DEFAULT_TRAINING,
        embed_dim: int = 256,
        fusion: FusionConfig | dict[str, Any] = DEFAULT_FUSION,
        itm: bool = True,
        adapters: TowerAdapters | None = None,
    ) -> None:
        super().__init__()
        self.image_config = ic = as_config(TowerTraining, image)
        self.text_config = tc = as_config(TowerTraining, text)
        fc = as_config(FusionConfig, fusion)
        self.embed_dim = embed_dim
        self.image_encoder = _checked_tower("image", image_tower)
        self.text_encoder = _checked_tower("text", text_tower)
        self._text_takes_types = takes_token_type_ids(self.text_encoder)
        # towers cut from a pretrained dual encoder (CLIP, SigLIP, open_clip) bring their projections
        self.image_proj = projection_for(
            self.image_encoder, self.image_encoder.pooled_dim, embed_dim, ic.project, "image"
        )
        self.text_proj = projection_for(
            self.text_encoder, self.text_encoder.pooled_dim, embed_dim, tc.project, "text"
        )
        loss = ContrastiveLoss() if loss is None else loss
        # a user's loss (a subclass of a built-in one too) is checked against the contract (losses/checks.py)
        if type(loss) not in BUILT_IN_LOSSES:
            check_loss(loss, embed_dim, needs_logits=itm)
        self.contrastive = loss
        take_over_logit_scale(self.contrastive, self.image_encoder, self.text_encoder)
        # built only when used: parameters without gradient would break DDP's reducer
        self.itm = (
            ImageTextMatching(
                self.image_encoder.token_dim,
                self.text_encoder.token_dim,
                embed_dim,
                fc.layers,
                fc.heads,
                fc.bidirectional,
            )
            if itm
            else None
        )
        self.adapters = adapters or TowerAdapters()
        self.image_encoder.requires_grad_(not ic.freeze)
        self.text_encoder.requires_grad_(not tc.freeze)
        for kind, tower, config in (("image", self.image_encoder, ic), ("text", self.text_encoder, tc)):
            if config.train_last is not None:
                if config.freeze:
                    raise ValueError(
                        f"model.{kind}.train_last trains part of the tower, model.{kind}.freeze locks all of it: "
                        "set one"
                    )
                train_last_groups(kind, tower, config.train_last)
            self.adapters.apply(kind, tower, config)
        # Lightning keeps each submodule's mode as found, so frozen towers must start in eval mode
        self.train()

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, map_location: Any = "cpu", **parts: nn.Module
    ) -> DualEncoder:
        """The network of a training checkpoint, its parts rebuilt from their recorded ``class_path``.

        A module built in Python records no parts: pass them (``image_tower=..., text_tower=..., loss=...``).
        """
        from mm_lightning.checkpoints.loading import network_from_checkpoint

        return network_from_checkpoint(cls, path, map_location, parts)

    @property
    def data_config(self) -> dict[str, dict[str, Any]]:
        """The preprocessing the towers expect: ``image`` (mean, std, input_size...), ``text`` (tokenizer)."""
        image = {"pretrained": False, **data_config_of(self.image_encoder)}
        return {"image": image, "text": data_config_of(self.text_encoder)}

    @override
    def train(self, mode: bool = True) -> DualEncoder:
        super().train(mode)
        for tower, config in ((self.image_encoder, self.image_config), (self.text_encoder, self.text_config)):
            if config.freeze:  # frozen towers keep BatchNorm statistics and dropout off (LiT)
                tower.eval()
                continue
            if config.train_last is not None:  # the locked lower layers, as above
                keep_locked_layers_in_eval(tower)
            if config.freeze_batchnorm:
                for module in batchnorm_layers(tower).values():
                    module.eval()
        return self

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute the towers' activations in backward instead of storing them."""
        set_gradient_checkpointing("image", self.image_encoder, enabled)
        set_gradient_checkpointing("text", self.text_encoder, enabled)

    def compile_towers(self, options: dict[str, Any]) -> None:
        """Compiles both towers in place with ``torch.compile`` (checkpoint keys do not change)."""
        # caption lengths change every batch, so the text tower is compiled for dynamic shapes from the start
        self.image_encoder.compile(**options)
        self.text_encoder.compile(**({"dynamic": True} | options))

    def encode_images(self, images: Tensor) -> tuple[EncoderOutput, Tensor]:
        """The image tower's output and the unnormalized projected embeddings of (B, 3, H, W) images.

        A (B, D) batch is the tower's precomputed pooled output (a locked tower's, say): the tower is not run.
        """
        if images.dim() == 2:
            mask = torch.ones(images.shape[0], 1, dtype=torch.bool, device=images.device)
            return EncoderOutput(images, images[:, None], mask), self.image_proj(images)
        out = as_encoder_output(self.image_encoder(images))
        return out, self.image_proj(out.pooled)

    def encode_text(self, batch: dict[str, Tensor]) -> tuple[EncoderOutput, Tensor]:
        """The text tower's output and the projected (unnormalized) caption embeddings of a batch."""
        ids = batch["input_ids"]
        raw = call_text_tower(
            self.text_encoder,
            ids,
            batch["attention_mask"],
            batch.get("token_type_ids"),
            self._text_takes_types,
        )
        out = as_encoder_output(raw)
        return out, self.text_proj(out.pooled)

    @torch.no_grad()
    def embed_images(self, images: Tensor) -> Tensor:
        """L2-normalized fp32 embeddings of (B, 3, H, W) normalized images (inference)."""
        return l2_normalize(self.encode_images(images)[1])

    @torch.no_grad()
    def embed_text(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """L2-normalized fp32 embeddings of tokenized captions (accepts ``**tokenizer(...)``)."""
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return l2_normalize(self.encode_text(batch)[1])

    @override
    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """L2-normalized fp32 image and text embeddings of a batch (one row per pair)."""
        return {
            "image_embeddings": l2_normalize(self.encode_images(batch["image"])[1]),
            "text_embeddings": l2_normalize(self.encode_text(batch)[1]),
        }

    def losses(
        self,
        ids: Tensor,
        weights: Tensor | None,
        image_out: EncoderOutput,
        image_emb: Tensor,
        text_out: EncoderOutput,
        text_emb: Tensor,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The loss terms by name (``itc``, ``itm``, a loss's own) and the other metrics (``itm_accuracy``).

        ``ids`` are the (B,) image ids: captions of one image are not each other's negatives.
        """
        if self.itm is None:
            return loss_terms(self.contrastive, self.contrastive(image_emb, text_emb, ids, weights)), {}
        value, logits = self.contrastive.loss_and_logits(image_emb, text_emb, ids, weights)
        terms = loss_terms(self.contrastive, value, reserved=("itm",))
        terms["itm"], itm_accuracy = self.itm(
            image_out.tokens, text_out.tokens, text_out.mask, logits, ids, weights
        )
        return terms, {"itm_accuracy": itm_accuracy}


def _checked_tower(kind: str, tower: Any) -> nn.Module:
    """A built-in tower as it is (it fulfils the contract by construction); a tower of your own checked once."""
    if isinstance(tower, Tower):
        return tower
    from mm_lightning.models.towers.user_towers import adopt_tower

    return adopt_tower(kind, tower)
