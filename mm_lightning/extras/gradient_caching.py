"""Exact large-batch contrastive gradients on the memory of a small batch (gradient caching).

A contrastive loss couples every pair of the batch, so ordinary gradient accumulation (k micro-batches, each
scored only against its own negatives) optimizes a different, weaker objective. Gradient caching (Gao et al.,
"Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", 2021) keeps the full-batch
objective and its exact gradient:

1. pass 1 embeds the batch chunk by chunk without an autograd graph, remembering each chunk's random state;
2. the loss, and every head on top of the embeddings (temperature, SigLIP bias, ITM fusion), runs once on the
   full batch of detached embeddings; its backward gives the heads' parameter gradients (counted once) and the
   gradient of the loss with respect to every embedding;
3. pass 2 re-embeds each chunk with a graph, replaying its random state so that dropout and drop-path masks
   equal pass 1's, and back-propagates the cached embedding gradients into the towers.

Peak activation memory is one chunk's; the price is one extra forward of the towers.

``MultimodalModule`` embeds its training batches in one forward (``WholeBatch``), or in chunks through
:class:`GradientCaching` here when a config names it; the training step is the same either way:

    model:
      batch_embedding:
        class_path: mm_lightning.extras.GradientCaching
        init_args: {chunks: 4}

Under ``DistributedDataParallel`` the gradient must be all-reduced once, after all chunks: chunks 1..k-1 are
back-propagated with :func:`torch.autograd.grad` (which does not run the parameters' gradient-accumulation
hooks that DDP listens to) and added to ``.grad`` by hand; the last chunk uses a normal backward, so DDP's
hooks fire once per parameter and reduce the full sum, exactly like the last micro-batch of accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states, set_device_states

from mm_lightning.models.rules import WholeBatch
from mm_lightning.models.towers.contract import EncoderOutput, batchnorm_layers

Batch = Mapping[str, Any]
Encode = Callable[[Batch], dict[str, Tensor]]


@dataclass
class _RandomState:
    """CPU and accelerator generator states, captured before a chunk's pass-1 forward."""

    cpu: Tensor
    devices: list[int]
    device_states: list[Tensor]

    @classmethod
    def capture(cls, tensors: list[Tensor]) -> _RandomState:
        devices, states = get_device_states(*tensors)
        return cls(torch.get_rng_state(), devices, states)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Runs the block with this random state; the caller's generators are untouched afterwards."""
        # the same save/restore that torch.utils.checkpoint does around its recomputation
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.device_states)
            yield


@dataclass
class _Autocast:
    """The autocast setting of pass 1, re-entered in pass 2 (which runs later, inside backward)."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> _Autocast:
        return cls(device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def context(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


@dataclass
class _Pending:
    """What pass 2 needs: the chunks, their random states, and the full-batch leaves whose grads it reads."""

    encode: Encode
    chunks: list[dict[str, Any]]
    states: list[_RandomState]
    autocast: _Autocast
    leaves: dict[str, Tensor]
    sizes: list[int]


def dropout_layers(module: nn.Module) -> list[str]:
    """Names of the layers of ``module`` that drop at random in training (dropout, drop-path with p > 0)."""
    return [
        n
        for n, m in module.named_modules()
        if (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or getattr(m, "drop_prob", 0) > 0
    ]


def _listed(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def warn_if_inexact(chunks: int, towers: Mapping[str, tuple[nn.Module, Any]]) -> None:
    """Says at fit start what keeps a chunked step from equalling the whole batch's, by layer name.

    BatchNorm in training mode normalizes each chunk by its own statistics (a warning, with the fixes); dropout
    draws each chunk's masks apart from the whole batch's (a note: equal in distribution, not exactly).

    Args:
        chunks: chunks per batch.
        towers: ``{name: (tower, config)}``; a config's ``freeze`` / ``freeze_batchnorm`` are honoured.
    """
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    batchnorm, dropout = [], []
    for prefix, (tower, config) in towers.items():
        if config.freeze:  # frozen towers run in eval mode: exact
            continue
        if not config.freeze_batchnorm:
            batchnorm += [f"{prefix}.{name}" for name in batchnorm_layers(tower)]
        dropout += [f"{prefix}.{name}" for name in dropout_layers(tower)]
    if batchnorm:
        rank_zero_warn(
            f"Gradient caching ({chunks} chunks) with {len(batchnorm)} BatchNorm layer(s) in training mode"
            f" ({_listed(batchnorm)}): each chunk is normalized by its own statistics, so the step only"
            " approximates the whole batch's, and running statistics are updated once per chunk. For an exact"
            " step: --model.image.freeze_batchnorm true (BatchNorm normalizes with its running statistics; the"
            " text tower has the same option), freeze the tower, or use a GroupNorm/LayerNorm tower."
        )
    if dropout:
        rank_zero_info(
            f"Gradient caching ({chunks} chunks) with dropout in {len(dropout)} layer(s) ({_listed(dropout)}):"
            " each chunk draws its own masks (the same in both of its passes, not the whole batch's), so the step"
            " equals the whole batch's in distribution, not exactly; with dropout 0 it is exact."
        )


def check_strategy(strategy: object) -> None:
    """Raises a clear error for the distributed strategies gradient caching cannot run under.

    Sharded strategies (FSDP, DeepSpeed, model parallel) own their parameters' gradients and are not supported;
    they are another way to fit a large batch (see docs/scaling.md, large batches). ``DistributedDataParallel``
    must not look for unused parameters or assume a static graph (:func:`check_ddp_wrapper`, once it wraps the model):
    both decide which gradients are ready from the forward graph, and pass 1 builds no graph through the towers.

    Args:
        strategy: the trainer's strategy.
    """
    from lightning.pytorch.strategies import (
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
    )

    name = type(strategy).__name__
    if isinstance(strategy, FSDPStrategy | DeepSpeedStrategy | ModelParallelStrategy):
        raise ValueError(
            f"gradient caching (GradientCaching) does not run under the sharded strategy {name}: embed whole batches"
            " there (no model.batch_embedding), or use DDP / ddp_explicit with chunks"
        )


def check_ddp_wrapper(wrapped: object) -> None:
    """Refuses a ``DistributedDataParallel`` wrapper that would reduce the towers' gradients too early.

    Args:
        wrapped: The model as the strategy wraps it (``trainer.strategy.model``), once training starts.
    """
    for option in ("find_unused_parameters", "static_graph"):
        if getattr(wrapped, option, False):
            raise ValueError(
                f"gradient caching (GradientCaching) needs DDP with {option}=False: pass 1 builds no graph "
                "through the towers, so DDP would reduce their gradients before pass 2 computes them"
            )


def split_batch(batch: Batch, chunks: int) -> list[dict[str, Any]]:
    """Splits every tensor whose first dimension is the batch size into ``chunks`` contiguous pieces.

    Other values (strings, scalars, tensors of another length) are passed to every chunk unchanged. With fewer
    rows than ``chunks`` there are as many chunks as rows.
    """
    size = _batch_size(batch)
    parts = min(chunks, size)
    split = {
        key: torch.tensor_split(value, parts) if _is_row_tensor(value, size) else None
        for key, value in batch.items()
    }
    return [
        {key: (split[key][i] if split[key] is not None else value) for key, value in batch.items()}
        for i in range(parts)
    ]


def _is_row_tensor(value: Any, size: int) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == size


def _batch_size(batch: Batch) -> int:
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, Tensor) and v.dim() > 0}
    if not sizes:
        raise ValueError("gradient caching needs a batch with at least one tensor of rows")
    return max(sizes)


class GradientCache:
    """Runs towers in chunks without keeping their graphs, then back-propagates a full-batch loss exactly.

    Usage (what :class:`~mm_lightning.extras.gradient_caching.GradientCaching` does for ``MultimodalModule``)::

        cache = GradientCache([image_tower, text_tower], chunks=4)
        outputs = cache.embed(encode, batch)   # pass 1: full-batch outputs, leaves that require grad
        loss = loss_fn(outputs)                # heads and loss on the whole batch
        cache.backward(loss)                   # head gradients, then pass 2 into the towers

    Args:
        towers: the modules ``encode`` runs; their trainable parameters receive the pass-2 gradients and
            their buffers (BatchNorm statistics) are restored after pass 1, so only pass 2 updates them.
            Held as a plain list, so an owning module does not register them a second time.
        chunks: number of chunks per batch (1 still works, with one extra forward).
    """

    def __init__(self, towers: nn.Module | Sequence[nn.Module], chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"gradient caching needs chunks >= 1, got {chunks}")
        self.towers = [towers] if isinstance(towers, nn.Module) else list(towers)
        self.chunks = chunks
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        """True between :meth:`embed` and :meth:`backward`."""
        return self._pending is not None

    def _buffers(self) -> list[Tensor]:
        return list({id(b): b for t in self.towers for b in t.buffers()}.values())

    def embed(self, encode: Encode, batch: Batch) -> dict[str, Tensor]:
        """Pass 1: ``encode`` on each chunk without graph; returns the outputs concatenated over chunks.

        Floating-point outputs come back as leaves that require grad (the loss is built on them); other
        outputs (masks) are plain tensors. Every output must have the chunk's rows as first dimension.

        Args:
            encode: maps a chunk (a batch dict with fewer rows) to a dict of tensors.
            batch: the full batch.
        """
        chunks = split_batch(batch, self.chunks)
        # one tensor per device: whose generators pass 2 must replay
        tensors = list({v.device: v for v in batch.values() if isinstance(v, Tensor)}.values())
        autocast = _Autocast.capture(tensors[0].device.type)
        saved_buffers = [b.detach().clone() for b in self._buffers()]
        states, outputs = [], []
        with torch.no_grad():
            for chunk in chunks:
                states.append(_RandomState.capture(tensors))
                outputs.append(encode(chunk))
        for buffer, saved in zip(self._buffers(), saved_buffers, strict=True):
            buffer.copy_(saved)
        leaves = {}
        for key in outputs[0]:
            value = torch.cat([out[key] for out in outputs])
            leaves[key] = value.requires_grad_(True) if value.is_floating_point() else value
        sizes = [len(next(iter(out.values()))) for out in outputs]
        self._pending = _Pending(encode, chunks, states, autocast, leaves, sizes)
        return leaves

    def backward(self, loss: Tensor) -> None:
        """Back-propagates ``loss`` (built on :meth:`embed`'s outputs) into the heads, then into the towers.

        Args:
            loss: scalar built from the outputs of the last :meth:`embed` call (already scaled by a
                GradScaler or divided for accumulation, if any: the cached gradients inherit the scale).
        """
        if self._pending is None:
            raise RuntimeError("GradientCache.backward() called without a preceding embed()")
        pending, self._pending = self._pending, None
        loss.backward()
        grads = {
            key: leaf.grad.split(pending.sizes)
            for key, leaf in pending.leaves.items()
            if leaf.requires_grad and leaf.grad is not None
        }
        params = list({id(p): p for t in self.towers for p in t.parameters() if p.requires_grad}.values())
        if not grads or not params:
            return
        last = len(pending.chunks) - 1
        for i, (chunk, state) in enumerate(zip(pending.chunks, pending.states, strict=True)):
            with state.replayed(), pending.autocast.context():
                out = pending.encode(chunk)
            keys = [k for k in grads if out[k].requires_grad]
            outputs, grad_outputs = [out[k] for k in keys], [grads[k][i] for k in keys]
            if not outputs:
                continue
            if i < last:
                _accumulate_quietly(outputs, grad_outputs, params)
            else:
                torch.autograd.backward(outputs, grad_outputs)


def _accumulate_quietly(
    outputs: list[Tensor], grad_outputs: list[Tensor], params: list[nn.Parameter]
) -> None:
    """Adds d(outputs)/d(params) . grad_outputs to ``.grad`` without running gradient-accumulation hooks.

    ``torch.autograd.grad`` returns the gradients instead of accumulating them, so DDP's reducer (which
    listens to those hooks) does not all-reduce a partial gradient; the last chunk's ordinary backward
    triggers one reduction of the full sum.
    """
    chunk_grads = torch.autograd.grad(outputs, params, grad_outputs, allow_unused=True)
    for param, grad in zip(params, chunk_grads, strict=True):
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad.add_(grad)


Embedded = tuple[EncoderOutput, Tensor, EncoderOutput, Tensor]


class GradientCaching(WholeBatch):
    """Embeds a training batch in ``chunks`` chunks with exact gradient caching (``model.batch_embedding``).

    Args:
        chunks: chunks per batch (> 1).
    """

    def __init__(self, chunks: int = 4) -> None:
        if chunks < 2:
            raise ValueError(
                f"GradientCaching needs chunks >= 2 (1 is the whole batch: no batch_embedding), got {chunks}"
            )
        self.chunks = chunks
        self.cache: GradientCache | None = None

    def _cache(self, model: Any) -> GradientCache:
        parts = [model.image_encoder, model.text_encoder, model.image_proj, model.text_proj]
        if self.cache is None or self.cache.towers[0] is not parts[0]:  # one rule may serve several modules
            self.cache = GradientCache(parts, self.chunks)
        return self.cache

    def setup(self, trainer_strategy: object, model: Any) -> None:
        """Refuses a strategy it cannot be exact under; names the towers' layers that make it inexact."""
        check_strategy(trainer_strategy)
        warn_if_inexact(
            self.chunks,
            {
                "image_encoder": (model.image_encoder, model.image_config),
                "text_encoder": (model.text_encoder, model.text_config),
            },
        )

    def check_wrapper(self, wrapped: object) -> None:
        """Refuses a DDP wrapper that would reduce the towers' gradients before pass 2 computes them."""
        check_ddp_wrapper(wrapped)

    def embed(self, model: Any, batch: Batch) -> Embedded:
        """Pass 1: the whole batch's outputs, chunk by chunk without graph."""
        return embed_in_chunks(
            self._cache(model), model.encode_images, model.encode_text, batch, tokens=model.itm is not None
        )

    def backward(self, loss: Tensor) -> bool:
        """The heads' backward, then pass 2 into the towers."""
        if self.cache is None or not self.cache.pending:
            return False
        self.cache.backward(loss)
        return True


def embed_in_chunks(
    cache: GradientCache,
    encode_images: Callable[[Tensor], tuple[EncoderOutput, Tensor]],
    encode_text: Callable[[Batch], tuple[EncoderOutput, Tensor]],
    batch: Batch,
    tokens: bool,
) -> tuple[EncoderOutput, Tensor, EncoderOutput, Tensor]:
    """Pass 1 for a two-tower model: ``(image_out, image_emb, text_out, text_emb)`` of the whole batch.

    Args:
        cache: the gradient cache (its ``backward`` then runs pass 2).
        encode_images: images -> (tower output, projected embedding).
        encode_text: batch -> (tower output, projected embedding).
        batch: the whole batch.
        tokens: keep the token sequences (an ITM head reads them); without, only the embeddings are kept.
    """

    def encode(chunk: Batch) -> dict[str, Tensor]:
        image_out, image_emb = encode_images(chunk["image"])
        text_out, text_emb = encode_text(chunk)
        out = {"image_emb": image_emb, "text_emb": text_emb}
        if tokens:
            out |= {"image_tokens": image_out.tokens, "image_mask": image_out.mask}
            out |= {"text_tokens": text_out.tokens, "text_mask": text_out.mask}
        return out

    out = cache.embed(encode, batch)
    none = out["image_emb"].new_empty(0)  # placeholders where no head reads tokens
    image_out = EncoderOutput(out["image_emb"], out.get("image_tokens", none), out.get("image_mask", none))
    text_out = EncoderOutput(out["text_emb"], out.get("text_tokens", none), out.get("text_mask", none))
    return image_out, out["image_emb"], text_out, out["text_emb"]
