"""A loss of your own, checked once on a dry batch when the model is built."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mm_lightning.models.losses.base import LossContractError, PairLogits, loss_problem, loss_terms


def check_loss(loss: Any, embed_dim: int, needs_logits: bool) -> dict[str, Tensor]:
    """Calls a user's loss once on a dry batch, checks it against the contract and returns its terms."""
    if not isinstance(loss, nn.Module):
        from mm_lightning.models.towers.contract import class_path_of

        raise LossContractError(
            f"loss {class_path_of(loss)} is not a torch.nn.Module (the pair-loss contract: "
            "mm_lightning/models/losses/base.py)"
        )
    if needs_logits and not callable(getattr(loss, "loss_and_logits", None)):
        raise loss_problem(
            loss,
            "the matching head (objective.itm_weight > 0) mines hard negatives from loss_and_logits(...), which it "
            "lacks; subclass mm_lightning.models.losses.PairLoss, or set model.objective.itm_weight 0",
        )
    g = torch.Generator().manual_seed(0)
    image_emb, text_emb = torch.randn(2, embed_dim, generator=g), torch.randn(2, embed_dim, generator=g)
    ids = torch.arange(2)
    try:
        with torch.no_grad():
            value = loss(image_emb, text_emb, ids, None)
            if needs_logits:
                pair = loss.loss_and_logits(image_emb, text_emb, ids, None)
                if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], PairLogits)):
                    raise loss_problem(loss, "loss_and_logits(...) must return (result, PairLogits)")
    except LossContractError:
        raise
    except Exception as error:  # noqa: BLE001  (any failure of the user's loss is reported with its class)
        raise loss_problem(
            loss,
            f"forward(image_emb, text_emb, image_ids, sample_weights) failed on a dry batch of 2 pairs of width "
            f"{embed_dim}: {type(error).__name__}: {error}",
        ) from error
    return loss_terms(loss, value, ("itm",) if needs_logits else ())
