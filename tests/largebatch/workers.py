"""Process bodies of the 2-process gloo tests (spawned; each rank saves its results to ``out_dir``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset

from mm_lightning.extras import ExplicitAllReduceDDPStrategy
from mm_lightning.extras import gradient_caching as gradcache
from mm_lightning.models.losses import siglip
from mm_lightning.models.losses.siglip import SigLipLoss
from tests.largebatch.lightning_helpers import Rows, SGDModule, fit_one_step
from tests.largebatch.toy import ToyModel, grads, toy_batch
from tests.models.helpers import EXACT_MODEL, gradient_caching, tiny_config, tiny_kwargs

PER_RANK, DIM = 6, 8


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


# ----------------------------------------------------------------------------- SigLIP
def siglip_features(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features and image ids of the whole batch (identical on every rank)."""
    g = torch.Generator().manual_seed(7)
    n = world * PER_RANK
    ids = torch.arange(n) // 2
    ids[PER_RANK - 1] = ids[PER_RANK]  # one image whose captions sit on two ranks
    return torch.randn(n, DIM, generator=g), torch.randn(n, DIM, generator=g), ids


def siglip_reference(world: int) -> dict[str, torch.Tensor]:
    img, txt, ids = siglip_features(world)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    loss_fn = SigLipLoss(global_negatives=False)
    loss = loss_fn(img, txt, ids)
    loss.backward()
    return {
        "loss": loss.detach(),
        "img": img.grad,
        "txt": txt.grad,
        "scale": loss_fn.logit_scale.grad,
        "bias": loss_fn.logit_bias.grad,
    }


def siglip_case(rank: int, world: int, global_negatives: bool = True) -> dict[str, torch.Tensor]:
    img, txt, ids = siglip_features(world)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    img, txt = img[rows].clone().requires_grad_(True), txt[rows].clone().requires_grad_(True)
    loss_fn = SigLipLoss(global_negatives=global_negatives)
    loss = loss_fn(img, txt, ids[rows])
    loss.backward()
    return {
        "loss": _mean_over_ranks(loss),
        # DDP averages parameter gradients; a rank's feature gradient is world x the single-process one
        "img": img.grad / world,
        "txt": txt.grad / world,
        "scale": _mean_over_ranks(loss_fn.logit_scale.grad),
        "bias": _mean_over_ranks(loss_fn.logit_bias.grad),
        "rows": torch.tensor([rows.start, rows.stop]),
    }


# ----------------------------------------------------------------------------- gradient caching under DDP
GC_PER_RANK, GC_CHUNKS = 8, 4


def gradcache_reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyModel(chunks=1)
    model(toy_batch(world * GC_PER_RANK)).backward()
    return grads(model)


def gradcache_case(rank: int, world: int) -> dict[str, torch.Tensor]:
    """One DDP step with 4 chunks per rank; forward through the DDP wrapper, as Lightning's DDP does."""
    torch.manual_seed(0)
    model = ToyModel(chunks=GC_CHUNKS)
    ddp = DistributedDataParallel(model)
    batch = toy_batch(world * GC_PER_RANK)
    rows = slice(rank * GC_PER_RANK, (rank + 1) * GC_PER_RANK)
    loss = ddp({k: v[rows] for k, v in batch.items()})
    model.backward(loss)
    return grads(model)


# ----------------------------------------------------------------------------- the module under Lightning's DDP
ROWS_PER_RANK = 8
# ITM off: its hard negatives are random draws whose order depends on the process layout
NO_ITM = tiny_config(EXACT_MODEL, objective={"itm_weight": 0.0})


def _module(chunks: int) -> SGDModule:
    torch.manual_seed(0)
    return SGDModule(**tiny_kwargs(NO_ITM, batch_embedding=gradient_caching(chunks)))


def module_reference(world: int) -> dict[str, torch.Tensor]:
    """One step on the concatenated batch in this single process, without chunks."""
    rows = Rows(world * ROWS_PER_RANK)
    return fit_one_step(_module(1), DataLoader(rows, batch_size=len(rows)))


def module_case(rank: int, world: int, strategy: DDPStrategy) -> dict[str, torch.Tensor]:
    """One Lightning step with 4 chunks per rank, inside this already-initialized process group."""
    rows = Subset(Rows(world * ROWS_PER_RANK), range(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK))
    loader = DataLoader(rows, batch_size=ROWS_PER_RANK)
    return fit_one_step(_module(4), loader, devices=world, strategy=strategy, use_distributed_sampler=False)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Runs every case in one process group (spawning is the slow part) and saves ``{case: result}``."""
    refs = {
        "siglip": siglip_reference(world),
        "gradcache": gradcache_reference(world),
        "module": module_reference(world),
    }
    _init(rank, world, port)
    # Lightning sees an external launcher (like torchrun) and joins the existing process group
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    results = {
        "refs": refs,
        "siglip": siglip_case(rank, world),
        "siglip_local": siglip_case(rank, world, global_negatives=False),
        "gradcache_ddp": gradcache_case(rank, world),
        "module_ddp": module_case(rank, world, DDPStrategy()),
        "module_ddp_explicit": module_case(rank, world, ExplicitAllReduceDDPStrategy()),
    }
    # controls: an exchange that carries no gradient; chunk gradients accumulated with DDP's hooks running
    siglip._RingShiftWithGrad.apply = lambda tensor: siglip.ring_shift(tensor.detach())
    results["siglip_no_grad_exchange"] = siglip_case(rank, world)
    gradcache._accumulate_quietly = lambda outputs, grad_outputs, params: torch.autograd.backward(
        outputs, grad_outputs
    )
    results["gradcache_ddp_hooks_every_chunk"] = gradcache_case(rank, world)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
