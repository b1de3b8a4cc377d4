"""Sharded data parallelism (FSDP2, ``fully_shard``) over every process, with distributed checkpoints (DCP) that
are written atomically, read as data and resume on any number of processes.

Lightning's ``ModelParallelStrategy`` launches the processes and sets up the device mesh; this subclass shards the
network itself (the module needs no parallelism code): every repeated block of the towers and the fusion, then
the whole network, each a unit whose full parameters exist only while it runs. Every process reads its own part
of the global batch (Lightning's mesh would make them tensor-parallel peers). Activation checkpointing is the
module's own option (``model.gradient_checkpointing``)."""

from __future__ import annotations

import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from typing_extensions import override

from mm_lightning.checkpoints.files import replaced_copy, restore_replaced
from mm_lightning.checkpoints.io import fsync_dir
from mm_lightning.checkpoints.sharded import (
    META_FILE,
    RESHAPED_KEY,
    ShardedCheckpointError,
    is_sharded_checkpoint,
    load_sharded,
    read_meta,
)

# the network's methods a step or a command calls instead of forward: each gathers the root's parameters first
ENTRY_POINTS = ("encode_images", "encode_text", "losses", "embed_images", "embed_text")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DistributedCheckpoints(ParallelStrategy):
    """Checkpoints as folders in torch's distributed format (DCP), for a strategy whose processes hold different
    parts of the state: every process writes its own, into a new folder that then replaces the old one, and a
    resume reads what this run's processes hold, all of it checked as data (:mod:`mm_lightning.checkpoints.sharded`)."""

    optimizer_state_options: StateDictOptions | None = None  # how optimizer states are keyed in the folder

    def reshaped_parameters(self) -> list[str]:
        """Parameters saved in another shape than the network's (read back in theirs)."""
        return []

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Each process writes its shards into a new folder beside ``filepath``, which then replaces it: an
        interrupted save leaves the previous checkpoint whole."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        target = Path(self.broadcast(str(filepath)))
        partial = target.with_name(f".{target.name}.partial")
        if self.global_rank == 0:
            restore_replaced(target)
            remove(replaced_copy(target))  # left by a save that died after its second rename
            remove(partial)
            target.parent.mkdir(parents=True, exist_ok=True)
        self.barrier()
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(state, checkpoint_id=partial)
        if self.global_rank == 0:
            checkpoint[RESHAPED_KEY] = self.reshaped_parameters()
            with open(partial / META_FILE, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            replaced = replaced_copy(target)
            if target.exists():
                os.replace(target, replaced)
            os.replace(partial, target)  # a crash before this line: the next save or resume renames it back
            fsync_dir(target.parent)
            remove(replaced)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a sharded checkpoint's model and optimizer state into this run's shards (any number of
        processes) and returns the rest (loops, callbacks), all read as data."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_sharded_checkpoint(path):
            raise ShardedCheckpointError(
                f"Checkpoint {path} is not a sharded checkpoint (a folder with .metadata): {type(self).__name__}"
                " resumes from its own folders; to start from a single file's weights, load them into the model"
                " (MultimodalModule.load_from_checkpoint) and fit without --ckpt_path."
            )
        module = self.lightning_module
        strict = module.strict_loading
        options = self.optimizer_state_options
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        for index, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{index}"] = get_optimizer_state_dict(module, optimizer, options=options)
        load_sharded(state, path, strict=strict)
        set_model_state_dict(module, state["state_dict"], options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{index}"], options=options)
        return read_meta(path)


class ShardedDataParallel(DistributedCheckpoints, ModelParallelStrategy):
    """FSDP2 over all processes: parameters, gradients and optimizer state sharded, each process its own data.

    Args:
        param_dtype: dtype the blocks compute in (``bfloat16`` on GPUs; none: the parameters' own).
        reduce_dtype: dtype gradients are reduced in (``float32`` keeps the reduction exact under bf16).
        reshard_after_forward: free each block's gathered parameters after its forward (gathered again in
            backward); false keeps them until backward, trading memory for one all-gather less.
        process_group_backend: ``gloo`` / ``nccl`` (none: from the device).
        timeout: of the collectives."""

    def __init__(
        self,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        reshard_after_forward: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ValueError(f"ShardedDataParallel: {name} {value!r} is not one of {sorted(DTYPES)}")
        self.mixed_precision = MixedPrecisionPolicy(
            param_dtype=DTYPES.get(param_dtype or ""), reduce_dtype=DTYPES.get(reduce_dtype or "")
        )
        self.reshard_after_forward = reshard_after_forward
        self.shard_mesh: DeviceMesh | None = None
        self.reshaped: list[str] = []

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.shard_mesh = init_device_mesh(self.root_device.type, (self.world_size,))

    @override
    def setup(self, trainer: Trainer) -> None:
        network = getattr(self.lightning_module, "model", None)
        if not isinstance(network, nn.Module):
            raise TypeError("ShardedDataParallel shards a MultimodalModule's network (.model); found none")
        if not isinstance(network, FSDPModule):  # a later stage (test after fit) finds it sharded
            self.shard(network)
        # Its entry points return views (a tower's tokens); FSDP2 warns that an in-place op on one would skip its
        # hook. The network changes no output in place (the weights equal DDP's: tests/resilience).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")
        super().setup(trainer)
        unsharded = [
            name
            for name, param in self.lightning_module.named_parameters()
            if param.requires_grad and not isinstance(param, DTensor)
        ]
        if unsharded:  # their gradients would never be averaged: the processes would drift apart
            raise TypeError(
                f"ShardedDataParallel shards the module's network (.model); these parameters are outside it:"
                f" {unsharded[:5]}. Keep trainable parameters in the network."
            )
        self.report_shards()

    def report_shards(self) -> None:
        """Says how many of the network's parameters each process holds (rank 0 prints it)."""
        local = sum(
            param.to_local().numel()
            for param in self.lightning_module.parameters()
            if isinstance(param, DTensor)
        )
        counts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(counts, local)
        total = sum(param.numel() for param in self.lightning_module.parameters())
        held = ", ".join(f"rank {rank} {count:,}" for rank, count in enumerate(counts))
        rank_zero_info(f"ShardedDataParallel: parameters held per process ({total:,} in all): {held}")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # as DDP does before each training forward: every process continues from rank 0's buffers (BatchNorm's
        # running statistics), which fully_shard leaves unsynchronized
        self.broadcast_buffers()
        return super().training_step(*args, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.broadcast_buffers()  # any process may write a replicated buffer: all hold rank 0's
        return super().lightning_module_state_dict()

    def broadcast_buffers(self) -> None:
        for buffer in self.lightning_module.buffers():
            torch.distributed.broadcast(buffer, src=0)

    @override
    def reshaped_parameters(self) -> list[str]:
        return self.reshaped

    def shard(self, network: nn.Module) -> None:
        """Shards each repeated block of ``network`` and then ``network`` itself (in place)."""
        options = {"mesh": self.shard_mesh, "mp_policy": self.mixed_precision}
        # fully_shard cannot split a 0-d parameter (the temperature): 1 element until a checkpoint is read whole
        self.reshaped = [f"model.{name}" for name in one_element_parameters(network)]
        for (
            param
        ) in network.parameters():  # fully_shard splits contiguous tensors only, not channels-last ones
            param.data = param.data.contiguous()
        for block in repeated_blocks(network):
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(network, **options)  # the root: what the blocks leave (projections, heads, temperature)
        for name in ENTRY_POINTS:
            if callable(getattr(network, name, None)):
                register_fsdp_forward_method(network, name)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def repeated_blocks(network: nn.Module) -> list[nn.Module]:
    """The children of every ``ModuleList``/``Sequential`` made of two or more modules of one class (transformer
    layers, ResNet stages' blocks), outermost first; not the blocks inside a chosen block."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, nn.ModuleList | nn.Sequential) and len(children) >= 2:
            kinds = {type(child) for child in children}
            if len(kinds) == 1 and any(p.numel() for p in module.parameters()):
                blocks.extend(children)
                return
        for child in children:
            visit(child)

    visit(network)
    return blocks


def one_element_parameters(network: nn.Module) -> list[str]:
    """Makes every 0-d parameter a 1-element one (the same value), which ``fully_shard`` can split; their names."""
    names = []
    for prefix, module in network.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), param.requires_grad))
                names.append(f"{prefix}.{name}" if prefix else name)
    return names
