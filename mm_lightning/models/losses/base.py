"""The pair-loss contract, the base classes that fulfil it, and the loss terms' weighting.

A loss takes ``(image_emb, text_emb, image_ids=None, sample_weights=None)`` and returns a scalar (the ``itc``
term) or a dict of named scalar terms; it owns its temperature and its data parallelism. With the matching
head on it also needs ``loss_and_logits`` (subclass :class:`PairLoss`); a loss that breaks this is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mm_lightning.distributed import all_reduce_mean
from mm_lightning.errors import ExplainedError


class PairLogits(NamedTuple):
    """Scores of the local rows against the candidate columns.

    ``targets``: (B,) column of each row's own pair. ``global_candidates``: the columns are the batch gathered
    over all ranks (N = world x B), so per-column data (token sequences) must be gathered the same way.
    """

    i2t: Tensor
    t2i: Tensor
    targets: Tensor
    candidate_ids: Tensor | None
    global_candidates: bool


class PairLoss(nn.Module):
    """Base of the image-text losses: ``forward`` = ``loss_from_logits(logits(...))``."""

    def logits(self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None) -> PairLogits:
        """Scores of local rows vs. (local or global) candidates (same-image rows are no negatives)."""
        raise NotImplementedError

    def loss_from_logits(self, logits: PairLogits, sample_weights: Tensor | None = None) -> Tensor:
        """The loss of the local rows from their logits, with optional (B,) ``sample_weights``."""
        raise NotImplementedError

    def loss_and_logits(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> tuple[Tensor, PairLogits]:
        """The loss of the local rows and the logits for hard-negative mining, sharing work where possible."""
        logits = self.logits(image_emb, text_emb, image_ids)
        return self.loss_from_logits(logits, sample_weights), logits

    @property
    def temperature(self) -> Tensor | None:
        """The current temperature (logged as ``train/temperature``), or None for a loss without one."""
        return None

    def forward(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Loss of the local rows: (B, D) unnormalized embeddings, row i of each is a pair."""
        return self.loss_from_logits(self.logits(image_emb, text_emb, image_ids), sample_weights)


class ScaledPairLoss(PairLoss):
    """A pair loss whose logits are cosine similarities times a learnable scale ``exp(t') = 1 / temperature``.

    Args:
        temperature_init: initial temperature (logit scale = 1 / temperature).
        learnable_temperature: train the temperature.
        max_logit_scale: upper clamp of the logit scale (CLIP uses 100).
        global_negatives: when distributed, score the local rows against the other ranks' rows too.
    """

    def __init__(
        self,
        temperature_init: float,
        learnable_temperature: bool,
        max_logit_scale: float,
        global_negatives: bool,
    ) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(
            torch.tensor(math.log(1.0 / temperature_init)), requires_grad=learnable_temperature
        )
        self.max_log_scale = math.log(max_logit_scale)
        self.global_negatives = global_negatives

    @property
    def temperature(self) -> Tensor:
        """Current temperature (1 / clamped logit scale)."""
        return 1.0 / self.scale()

    def scale(self) -> Tensor:
        """Clamped logit scale ``exp(t')``."""
        return self.logit_scale.clamp(max=self.max_log_scale).exp()


class LossContractError(ExplainedError, ValueError):
    """A user's loss does not do what the pair-loss contract (:mod:`mm_lightning.models.losses.base`) asks."""


def _loss_problem(loss: nn.Module, what: str) -> LossContractError:
    from mm_lightning.models.towers.contract import class_path_of

    return LossContractError(
        f"loss {class_path_of(loss)}: {what} (the pair-loss contract: mm_lightning/models/losses/base.py)"
    )


def loss_terms(loss: nn.Module, value: Any, reserved: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """A loss's result as named terms: a scalar is the ``itc`` term, a dict names its own."""
    terms = value if isinstance(value, dict) else {"itc": value}
    if not terms:
        raise _loss_problem(
            loss, "it returned an empty dict; a loss returns a scalar or a dict of named scalars"
        )
    for name, term in terms.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise _loss_problem(
                loss, f"term name {name!r} is not a plain name (it becomes train/loss_<name>)"
            )
        if name in reserved:
            raise _loss_problem(loss, f"term {name!r} is the matching head's; name it differently")
        if not isinstance(term, Tensor) or term.numel() != 1 or term.dim() > 1:
            shape = tuple(term.shape) if isinstance(term, Tensor) else type(term).__name__
            raise _loss_problem(
                loss,
                f"term {name!r} is {shape}, not a scalar tensor; a loss returns a scalar or a dict of scalars",
            )
    return {name: term.reshape(()) for name, term in terms.items()}


def check_loss(loss: Any, embed_dim: int, needs_logits: bool) -> dict[str, Tensor]:
    """Calls a user's loss once on a dry batch, checks it against the contract and returns its terms."""
    if not isinstance(loss, nn.Module):
        from mm_lightning.models.towers.contract import class_path_of

        raise LossContractError(
            f"loss {class_path_of(loss)} is not a torch.nn.Module (the pair-loss contract: "
            "mm_lightning/models/losses/base.py)"
        )
    if needs_logits and not callable(getattr(loss, "loss_and_logits", None)):
        raise _loss_problem(
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
                    raise _loss_problem(loss, "loss_and_logits(...) must return (result, PairLogits)")
    except LossContractError:
        raise
    except Exception as error:  # noqa: BLE001  (any failure of the user's loss is reported with its class)
        raise _loss_problem(
            loss,
            f"forward(image_emb, text_emb, image_ids, sample_weights) failed on a dry batch of 2 pairs of width "
            f"{embed_dim}: {type(error).__name__}: {error}",
        ) from error
    return loss_terms(loss, value, ("itm",) if needs_logits else ())


def l2_normalize(embeddings: Tensor) -> Tensor:
    """Unit-length fp32 rows (bf16/fp16 cosines are too coarse to rank thousands of candidates)."""
    return F.normalize(embeddings.float(), dim=-1)


def complexity_weights(images: Tensor, attention_mask: Tensor) -> Tensor:
    """Per-pair weights, mean 1 per batch, from image detail and caption length."""
    with torch.no_grad():
        img = images.float()
        detail = (img[..., 1:, :] - img[..., :-1, :]).abs().mean((1, 2, 3)) + (
            img[..., :, 1:] - img[..., :, :-1]
        ).abs().mean((1, 2, 3))
        length = attention_mask.float().sum(1)
        return 0.5 * (detail / detail.mean().clamp_min(1e-12) + length / length.mean().clamp_min(1e-12))


class DynamicWeightAveraging(nn.Module):
    """Dynamic Weight Averaging (Liu et al., 2019) over windows of training steps.

    After each window, weight_k = base_k * K * softmax_k(ratio_k / temperature), with ratio_k this window's
    mean loss / the previous one's; base weights until two windows are done. State lives in buffers.
    """

    def __init__(self, base_weights: list[float], window: int = 50, temperature: float = 2.0) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"DWA window must be >= 1, got {window}")
        self.window = window
        self.temperature = temperature
        base = torch.tensor(base_weights, dtype=torch.float32)
        self.register_buffer("base", base)
        self.register_buffer("weights", base.clone())
        self.register_buffer("window_sum", torch.zeros_like(base))
        self.register_buffer("previous_mean", torch.zeros_like(base))
        self.register_buffer("steps_in_window", torch.zeros((), dtype=torch.long))
        self.register_buffer("windows_done", torch.zeros((), dtype=torch.long))

    def update(self, losses: Tensor, reduce_mean: Callable[[Tensor], Tensor] = all_reduce_mean) -> Tensor:
        """Records this step's (K,) losses and returns this step's weights (same on every rank)."""
        self.window_sum += losses.detach().float().to(self.window_sum.device)
        self.steps_in_window += 1
        if int(self.steps_in_window) == self.window:
            window_sum = reduce_mean(self.window_sum)
            mean = window_sum / self.window
            if int(self.windows_done) >= 1:
                ratio = mean / self.previous_mean.clamp_min(1e-12)
                k = ratio.numel()
                self.weights.copy_(self.base * k * torch.softmax(ratio / self.temperature, dim=0))
            self.previous_mean.copy_(mean)
            self.window_sum.zero_()
            self.steps_in_window.zero_()
            self.windows_done += 1
        return self.weights


def weighted_sum(terms: dict[str, Tensor], weights: Mapping[str, Any]) -> Tensor:
    """The loss terms' sum, each times the weight of its name (1 when it has none), in the terms' order."""
    items = iter(terms.items())
    name, term = next(items)
    total = weights.get(name, 1.0) * term
    for name, term in items:
        total = total + weights.get(name, 1.0) * term
    return total
