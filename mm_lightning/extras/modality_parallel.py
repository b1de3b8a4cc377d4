"""Modality parallelism: the image tower trains on one group of processes and the text tower on another, each
group data-parallel inside itself, with the same losses and gradients as DDP on all the processes.

With ``W`` processes, ranks ``0 .. a-1`` hold the image tower and its projection, ranks ``a .. W-1`` the text
tower and its projection; every rank holds the shared heads (temperature, fusion, matching head). A step:

1. Each group reads the whole global batch ``G`` (``data.batch_size`` x ``W``), each of its ranks ``G / a`` (or
   ``G / b``) rows of it, and runs only its own tower over them: one forward per DDP rank's rows, each drawing
   dropout as that rank would and normalizing BatchNorm over those rows (exact when ``a`` and ``b`` divide ``W``).
2. One exchange moves the embeddings (and the token features the matching head reads) so that rank ``r`` holds
   rows ``[r G/W, (r+1) G/W)`` of both modalities: what DDP's rank ``r`` holds. Its backward sends the gradients
   back to the rows' owners.
3. Every rank computes DDP rank ``r``'s loss with the module's own code (gathers over all processes).
4. A tower's gradients are summed over its group, the heads' over all processes, both divided by ``W``: DDP's
   mean over ranks of gradients that each carry every rank's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.extras.explicit_allreduce.reducers import BucketedReducer
from mm_lightning.extras.feature_cache import LockedImageFeatures
from mm_lightning.extras.gradient_caching import dropout_layers
from mm_lightning.extras.sharded_training import DistributedCheckpoints
from mm_lightning.models.draws import seed_part
from mm_lightning.models.losses.objective import SampleWeighting
from mm_lightning.models.rules import Batch, Embedded, WholeBatch
from mm_lightning.models.towers.contract import EncoderOutput, batchnorm_layers

KINDS = ("image", "text")
ONE_PROCESS = "--trainer.devices 1 --trainer.strategy auto"


class ModalityParallelError(ExplainedError, ValueError):
    """A run that modality parallelism cannot reproduce (named in the message)."""


class AbsentTower(nn.Module):
    """Stands in for the tower that the other group of processes holds: no parameters, and a call says so."""

    def __init__(self, kind: str, ranks: list[int]) -> None:
        super().__init__()
        self.kind, self.ranks = kind, ranks

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"The {self.kind} tower is held by processes {self.ranks} (ModalityParallel): this process cannot run"
            " it. Evaluate or predict from the checkpoint on one process."
        )


@dataclass(frozen=True)
class Layout:
    """Which rows of the global batch each process holds: ``image`` ranks first, then ``text`` ranks."""

    image_processes: int
    text_processes: int

    @property
    def world(self) -> int:
        return self.image_processes + self.text_processes

    def kind(self, rank: int) -> str:
        return "image" if rank < self.image_processes else "text"

    def ranks(self, kind: str) -> list[int]:
        a = self.image_processes
        return list(range(a)) if kind == "image" else list(range(a, self.world))

    def owned(self, rank: int, rows: int) -> tuple[int, int]:
        """``[start, end)`` of the global batch's ``rows`` that ``rank`` embeds with its tower."""
        members = self.ranks(self.kind(rank))
        share = rows // len(members)
        index = members.index(rank)
        return index * share, (index + 1) * share

    def block(self, rank: int, rows: int) -> tuple[int, int]:
        """``[start, end)`` of the rows whose loss ``rank`` computes: DDP rank ``rank``'s part of the batch."""
        share = rows // self.world
        return rank * share, (rank + 1) * share

    def pieces(self, rank: int, rows: int) -> list[tuple[int, slice]]:
        """``(DDP rank, its rows among this process's own)`` for each DDP rank whose rows ``rank`` embeds."""
        start, end = self.owned(rank, rows)
        out = []
        for other in range(self.world):
            low, high = self.block(other, rows)
            if max(low, start) < min(high, end):
                out.append((other, slice(max(low, start) - start, min(high, end) - start)))
        return out

    def whole_blocks(self) -> bool:
        """Whether each DDP rank's rows are embedded by one process (each group's size divides the world)."""
        return all(self.world % size == 0 for size in (self.image_processes, self.text_processes))

    def sends(self, rank: int, rows: int) -> list[int]:
        """How many of its own rows ``rank`` sends to each process (itself included)."""
        start, end = self.owned(rank, rows)
        return [overlap((start, end), self.block(other, rows)) for other in range(self.world)]

    def receives(self, rank: int, rows: int) -> list[int]:
        """How many rows ``rank`` receives from each process: its block, from each modality's owners."""
        block = self.block(rank, rows)
        return [overlap(self.owned(other, rows), block) for other in range(self.world)]


def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


class _ExchangeRows(torch.autograd.Function):
    """``all_to_all_single`` of flat rows; the backward sends each row's gradient back to where it came from."""

    @staticmethod
    def forward(
        ctx: Any, flat: Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup | None
    ) -> Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = flat.new_empty(sum(receive))
        dist.all_to_all_single(out, flat.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def exchange_rows(flat: Tensor, send: list[int], receive: list[int]) -> Tensor:
    """Sends ``send[p]`` consecutive elements of ``flat`` to each process ``p`` and returns what arrives, in
    rank order; differentiable. Every process must call it in each step's forward and reach it in backward, so
    the sent tensor always requires a gradient (a frozen tower's rows get a zero one)."""
    if not flat.requires_grad:
        flat = flat.detach().requires_grad_()
    return _ExchangeRows.apply(flat, send, receive, None)


class ModalityExchange(WholeBatch):
    """The batch embedding under :class:`ModalityParallel`: this process's tower over its rows, then the exchange
    that leaves it DDP rank ``r``'s rows of both modalities, on which the module's loss code runs unchanged.

    Args:
        layout: the two groups.
        rank: this process's rank.
        token_dims: each tower's token width (the matching head's input), by kind."""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        token_dims: dict[str, int],
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
    ) -> None:
        self.layout, self.rank, self.kind = layout, rank, layout.kind(rank)
        self.token_dims = token_dims
        self.pad_to_multiple_of, self.padding_side = pad_to_multiple_of, padding_side
        self.rows: Batch = {}

    def embed(self, model: Any, batch: Batch) -> Embedded:
        rows = batch["image_id"].shape[0] * len(self.layout.ranks(self.kind))
        with_tokens = model.itm is not None
        out, emb, lengths = self.own_tower(model, batch, rows, with_tokens)
        (image_out, image_emb), (text_out, text_emb) = self.exchange(
            rows, emb, out if with_tokens else None, lengths
        )
        self.rows = {"image_id": self.exchange_ids(batch["image_id"], rows)}
        return image_out, image_emb, text_out, text_emb

    def own_tower(
        self, model: Any, batch: Batch, rows: int, with_tokens: bool
    ) -> tuple[EncoderOutput, Tensor, dict[int, int]]:
        """This process's tower over its rows, one forward per DDP rank's rows, as that rank runs it: its own
        dropout draws, BatchNorm over its rows, its captions padded to their longest. The running statistics
        kept are the first forward's (DDP keeps its first process's). Also returns each DDP rank's token count."""
        pieces = self.layout.pieces(self.rank, rows)
        if self.kind == "text":  # one host sync for every piece's caption length
            real = batch["attention_mask"].sum(1)
            longest = torch.stack([real[rows_of].max() for _, rows_of in pieces]).tolist()
        layers = [
            layer
            for part in (getattr(model, f"{self.kind}_encoder"), getattr(model, f"{self.kind}_proj"))
            for layer in batchnorm_layers(part).values()
        ]
        first = [dict(layer.named_buffers(recurse=False)) for layer in layers]
        parts = []
        try:
            for index, (ddp_rank, rows_of) in enumerate(pieces):
                if index:  # later forwards update copies (the first's tensors are saved for its backward)
                    for layer, buffers in zip(layers, first, strict=True):
                        for name, buffer in buffers.items():
                            setattr(layer, name, buffer.detach().clone())
                seed_part(self.kind, rank=ddp_rank)
                if self.kind == "image":
                    parts.append(model.encode_images(batch["image"][rows_of]))
                else:
                    length = padded_length(
                        longest[index], self.pad_to_multiple_of, batch["input_ids"].shape[1]
                    )
                    parts.append(model.encode_text(caption_rows(batch, rows_of, length, self.padding_side)))
        finally:
            for layer, buffers in zip(layers, first, strict=True):
                for name, buffer in buffers.items():
                    setattr(layer, name, buffer)
        lengths = {
            ddp_rank: out.tokens.shape[1] for (ddp_rank, _), (out, _) in zip(pieces, parts, strict=True)
        }
        if len(parts) == 1:
            return (*parts[0], lengths)
        return (*joined([(emb, out.tokens, out.mask) for out, emb in parts], with_tokens), lengths)

    def loss_rows(self, batch: Batch) -> Batch:
        """The image ids of this process's block (what the loss reads of a batch)."""
        return self.rows

    def exchange(
        self, rows: int, emb: Tensor, out: EncoderOutput | None, lengths: dict[int, int] | None = None
    ) -> list[tuple[EncoderOutput, Tensor]]:
        """``(output, embedding)`` of this process's block, image then text. A row travels as one flat vector:
        the embedding, then (for the matching head) the tokens and their mask; ``lengths`` gives each DDP rank's
        token count among this process's rows (default: all of ``out``'s), to which its block is cut back."""
        layout, world = self.layout, self.layout.world
        table = self.token_lengths(out, rows, lengths, emb.device)
        sent = [max(row) for row in table]  # each process's rows travel padded to its longest
        dim = emb.shape[1]
        widths = [dim + sent[p] * (self.token_dims[layout.kind(p)] + 1) for p in range(world)]
        dtype = torch.float64 if emb.dtype == torch.float64 else torch.float32  # one dtype on every process
        pieces = [emb] if out is None else [emb, out.tokens.flatten(1), out.mask]
        packed = torch.cat([piece.to(dtype) for piece in pieces], dim=1)
        send, receive = layout.sends(self.rank, rows), layout.receives(self.rank, rows)
        received = exchange_rows(
            packed.reshape(-1),
            [count * widths[self.rank] for count in send],
            [count * widths[p] for p, count in enumerate(receive)],
        )
        parts: dict[str, list[tuple[Tensor, Tensor, Tensor]]] = {kind: [] for kind in KINDS}
        for p, chunk in enumerate(received.split([count * widths[p] for p, count in enumerate(receive)])):
            if receive[p]:
                rows_of = chunk.reshape(receive[p], widths[p])
                kind, length, kept = layout.kind(p), sent[p], table[p][self.rank]
                width = self.token_dims[kind]
                tokens = rows_of[:, dim : dim + length * width].reshape(receive[p], length, width)
                mask = rows_of[:, widths[p] - length :] > 0.5
                parts[kind].append((rows_of[:, :dim], tokens[:, :kept], mask[:, :kept]))
        return [joined(parts[kind], out is not None) for kind in KINDS]

    def token_lengths(
        self, out: EncoderOutput | None, rows: int, lengths: dict[int, int] | None, device: torch.device
    ) -> list[list[int]]:
        """``[p][r]``: the token count of DDP rank ``r``'s rows as process ``p`` embedded them (0 where it holds
        none, and without the matching head)."""
        world = self.layout.world
        if out is None:
            return [[0] * world for _ in range(world)]
        if lengths is None:
            lengths = {ddp_rank: out.tokens.shape[1] for ddp_rank, _ in self.layout.pieces(self.rank, rows)}
        mine = torch.zeros(world, dtype=torch.long, device=device)
        for ddp_rank, length in lengths.items():
            mine[ddp_rank] = length
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return torch.stack(every).tolist()

    def exchange_ids(self, image_id: Tensor, rows: int) -> Tensor:
        """Image ids of this process's block, from the image tower's processes (no gradient)."""
        layout = self.layout
        send = layout.sends(self.rank, rows) if self.kind == "image" else [0] * layout.world
        receive = [
            count if layout.kind(p) == "image" else 0
            for p, count in enumerate(layout.receives(self.rank, rows))
        ]
        out = image_id.new_empty(sum(receive))
        dist.all_to_all_single(
            out, image_id.contiguous() if self.kind == "image" else image_id[:0], receive, send
        )
        return out


def caption_rows(batch: Batch, rows: slice, length: int, padding_side: str = "right") -> Batch:
    """The captions of ``rows`` cut to ``length`` tokens from the padded side, as a batch of only them is padded."""
    columns = slice(-length, None) if padding_side == "left" else slice(0, length)
    keys = ("input_ids", "attention_mask", "token_type_ids")
    return {key: batch[key][rows, columns] for key in keys if batch.get(key) is not None}


def padded_length(longest: int, pad_to_multiple_of: int | None, width: int) -> int:
    """The token length a collate pads captions of ``longest`` real tokens to (rounded up to a multiple, as the
    tokenizer does), at most the batch's ``width``."""
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return min(longest, width)


def joined(parts: list[tuple[Tensor, Tensor, Tensor]], with_tokens: bool) -> tuple[EncoderOutput, Tensor]:
    """One kind's ``(output, embedding)`` from pieces ``(embedding, tokens, mask)``, tokens padded to the
    longest."""
    emb = torch.cat([part[0] for part in parts])
    if not with_tokens:  # the loss reads the embeddings only
        return EncoderOutput(emb, emb[:, None], torch.ones_like(emb[:, :1], dtype=torch.bool)), emb
    longest = max(part[1].shape[1] for part in parts)
    tokens = torch.cat([F.pad(part[1], (0, 0, 0, longest - part[1].shape[1])) for part in parts])
    mask = torch.cat([F.pad(part[2], (0, longest - part[2].shape[1]), value=False) for part in parts])
    return EncoderOutput(emb, tokens, mask), emb


class ModalityParallel(DistributedCheckpoints, ModelParallelStrategy):
    """The image tower on the first ``image_processes`` processes, the text tower on the rest; each process holds
    its tower, its projection and the shared heads, and their optimizer state (see the module's docs).

    Checkpoints are folders (torch's distributed checkpoint): each group writes its tower, and a resume reads each
    process's part by name. Validation, test and prediction run on one process from a checkpoint.

    Args:
        image_processes: processes running the image tower; the others run the text tower.
        process_group_backend: ``gloo`` / ``nccl`` (none: from the device).
        timeout: of the collectives."""

    # keyed by parameter name: the two groups' optimizers number their parameters alike
    optimizer_state_options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(
        self,
        image_processes: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if image_processes < 1:
            raise ValueError(f"ModalityParallel: image_processes {image_processes} must be at least 1")
        self.image_processes = image_processes
        self.layout: Layout | None = None
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.reducers: list[BucketedReducer] = []

    @property
    def text_processes(self) -> int:
        return self.world_size - self.image_processes

    @property
    def kind(self) -> str:
        assert self.layout is not None
        return self.layout.kind(self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # each group reads the whole global batch, each of its processes an equal part
        assert self.layout is not None
        ranks = self.layout.ranks(self.kind)
        return {"num_replicas": len(ranks), "rank": ranks.index(self.global_rank)}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.text_processes < 1:
            raise ModalityParallelError(
                f"ModalityParallel: image_processes {self.image_processes} leaves none of the {self.world_size}"
                " processes for the text tower; set trainer.devices (x num_nodes) above it"
            )
        self.layout = Layout(self.image_processes, self.text_processes)
        self.create_groups()

    def create_groups(self) -> None:
        """One process group per tower; every process creates both, in the same order (a collective)."""
        assert self.layout is not None
        self.groups = {kind: dist.new_group(self.layout.ranks(kind)) for kind in KINDS}

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            raise ModalityParallelError(
                f"ModalityParallel trains only: {trainer.state.fn.value} needs both towers in one process; add"
                f" {ONE_PROCESS} (the checkpoint folder is read whole)"
            )
        if trainer.limit_val_batches != 0:
            raise ModalityParallelError(
                "ModalityParallel: validation needs both towers in one process; set trainer.limit_val_batches 0"
                f" (configs/modality_parallel.yaml does) and evaluate the checkpoint with {ONE_PROCESS}"
            )
        module = self.lightning_module
        self.check_training(module, trainer)
        network = module.model.to(self.root_device)  # NCCL broadcasts device tensors only
        for tensor in network.state_dict().values():  # DDP starts every process from rank 0's weights
            dist.broadcast(tensor, src=0)
        token_dims = {kind: getattr(getattr(network, f"{kind}_encoder"), "token_dim", 0) for kind in KINDS}
        self.warn_if_inexact(network)
        other = "text" if self.kind == "image" else "image"
        setattr(network, f"{other}_encoder", AbsentTower(other, self.layout.ranks(other)))
        setattr(network, f"{other}_proj", AbsentTower(other, self.layout.ranks(other)))
        collate = getattr(trainer.datamodule, "collate", None)  # how the captions were padded
        module.batch_embedding = ModalityExchange(
            self.layout,
            self.global_rank,
            token_dims,
            getattr(collate, "pad_to_multiple_of", None),
            getattr(getattr(collate, "tokenizer", None), "padding_side", "right"),
        )
        super().setup(trainer)
        own = [p for name, p in network.named_parameters() if owned_by(name, self.kind) and p.requires_grad]
        owned = {id(p) for p in own}
        shared = [p for p in module.parameters() if p.requires_grad and id(p) not in owned]
        divisor = self.world_size  # DDP's mean over all processes
        self.reducers = [
            BucketedReducer(own, group=self.groups[self.kind], divisor=divisor),
            BucketedReducer(shared, divisor=divisor),
        ]
        self.report_towers(own, shared)

    def check_training(self, module: LightningModule, trainer: Trainer) -> None:
        """Refuses what this split cannot reproduce, each in one line."""
        if type(module.batch_embedding) is not WholeBatch:
            raise ModalityParallelError(
                f"ModalityParallel embeds each tower on its own processes; model.batch_embedding"
                f" {type(module.batch_embedding).__name__} cannot run with it"
            )
        if type(module.objective.sample_weighting) is not SampleWeighting:
            raise ModalityParallelError(
                "ModalityParallel: model.sample_weighting reads a batch's rows, which the towers' processes"
                " split; train with equal weights"
            )
        if module.optim_config.clip_heads is not None or trainer.gradient_clip_val:
            raise ModalityParallelError(
                "ModalityParallel: clipping the heads or all gradients needs norms over both groups;"
                " clip per tower (model.image.clip_norm, model.text.clip_norm)"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:  # each group would skip its own steps
            raise ModalityParallelError(
                "ModalityParallel: fp16's loss scaling skips a step on the processes whose gradients overflowed"
                " only; train in bf16-mixed or 32-true"
            )
        if any(isinstance(callback, LockedImageFeatures) for callback in trainer.callbacks):
            raise ModalityParallelError(
                "ModalityParallel: LockedImageFeatures encodes images on every process; the text tower's processes"
                " hold no image tower"
            )
        towers = [module.model.image_encoder, module.model.text_encoder]
        parts = [
            getattr(module.model, f"{kind}_{part}", None) for kind in KINDS for part in ("encoder", "proj")
        ]
        if any(isinstance(layer, nn.SyncBatchNorm) for part in parts if part for layer in part.modules()):
            raise ModalityParallelError(
                "ModalityParallel: SyncBatchNorm gathers statistics over processes that hold different towers;"
                " use BatchNorm (each DDP process's statistics, which this strategy reproduces) or freeze it"
            )
        batchnorm = any(layer.training for tower in towers for layer in batchnorm_layers(tower).values())
        if module.hparams.get("gradient_checkpointing") and batchnorm:
            raise ModalityParallelError(
                "ModalityParallel: gradient checkpointing recomputes the tower in backward, which would add every"
                " DDP process's rows to BatchNorm's running statistics; set model.image.freeze_batchnorm (or"
                " model.text's) or model.gradient_checkpointing false"
            )
        batch_size = getattr(trainer.datamodule, "hparams", {}).get("batch_size")
        groups = (self.image_processes, self.text_processes)
        if batch_size is not None and any(batch_size * self.world_size % processes for processes in groups):
            raise ModalityParallelError(
                f"ModalityParallel: a global batch of data.batch_size {batch_size} x {self.world_size} processes"
                f" does not split over {self.image_processes} image and {self.text_processes} text processes;"
                " choose a batch size that makes it a multiple of both"
            )

    def warn_if_inexact(self, network: nn.Module) -> None:
        """A group whose size does not divide the world embeds some DDP rank's rows on two processes: its
        BatchNorm statistics and dropout draws then differ from DDP's. Says so once, naming the layers."""
        assert self.layout is not None
        if self.layout.whole_blocks():
            return
        for kind in KINDS:
            tower = getattr(network, f"{kind}_encoder")
            layers = [name for name, layer in batchnorm_layers(tower).items() if layer.training]
            layers += dropout_layers(tower) if tower.training else []
            if layers:
                sizes = (self.image_processes, self.text_processes)
                rank_zero_warn(
                    f"ModalityParallel: {sizes[0]} image and {sizes[1]} text processes do not each divide the"
                    f" {self.world_size} processes, so some rows DDP embeds on one process are split over two: the"
                    f" {kind} tower's {', '.join(layers[:4])} (BatchNorm statistics, dropout draws) then differ"
                    " from DDP's and the run is not DDP's step for step. Choose group sizes that divide the"
                    f" world, or model.{kind}.freeze_batchnorm and dropout 0."
                )

    def report_towers(self, own: list[nn.Parameter], shared: list[nn.Parameter]) -> None:
        """Says which process holds which tower, and how many parameters (rank 0 prints it)."""
        mine = (self.kind, sum(p.numel() for p in own), sum(p.numel() for p in shared))
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        held = "; ".join(
            f"rank {rank}: {kind} tower {count:,} trained parameters, heads {heads:,}"
            for rank, (kind, count, heads) in enumerate(every)
        )
        rank_zero_info(f"ModalityParallel: {held}")

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        sampler = self.lightning_module.trainer.train_dataloader.sampler
        if (
            getattr(sampler, "order_follows_batch_size", False)
            and self.image_processes != self.text_processes
        ):
            raise ModalityParallelError(
                "ModalityParallel: the training order is cut into groups of each reader's batch, which differ"
                " between the towers' processes; use the default data.train_order"
            )

    @override
    def teardown(self) -> None:
        # Each tower's group is closed now, while the interpreter is whole: a gloo group whose last reference
        # goes at interpreter exit can abort the process (see mm_lightning/gloo_exit_abort.py).
        try:
            if dist.is_initialized():
                for group in self.groups.values():
                    dist.destroy_process_group(group)
        finally:
            self.groups, self.reducers = {}, []
            super().teardown()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.broadcast_buffers()
        return super().training_step(*args, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.broadcast_buffers()  # saved from any process: all hold their group's first process's, as DDP's
        return super().lightning_module_state_dict()

    def broadcast_buffers(self) -> None:
        """As DDP before each forward: each tower's buffers (BatchNorm statistics) from its group's first
        process, the heads' from rank 0."""
        assert self.layout is not None
        if not self.groups:  # closed when fit ended: a checkpoint saved after it (every process saves)
            self.create_groups()
        network = self.lightning_module.model
        first = self.layout.ranks(self.kind)[0]
        for name, buffer in network.named_buffers():
            if owned_by(name, self.kind):
                dist.broadcast(buffer, src=first, group=self.groups[self.kind])
            else:
                dist.broadcast(buffer, src=0)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            for reducer in self.reducers:
                reducer.reduce()
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        # the schedules' state is rank 0's (an image process): each process keeps its own groups' rates
        for state, optimizer in zip(checkpoint.get("lr_schedulers", []), self.optimizers, strict=False):
            state["base_lrs"] = [group["initial_lr"] for group in optimizer.param_groups]
            state["_last_lr"] = [group["lr"] for group in optimizer.param_groups]
        return checkpoint


def owned_by(name: str, kind: str) -> bool:
    """Whether the network's parameter or buffer ``name`` belongs to the ``kind`` tower or its projection."""
    return name.split(".", 1)[0] in (f"{kind}_encoder", f"{kind}_proj")
