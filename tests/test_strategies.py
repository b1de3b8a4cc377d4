"""ExplicitAllReduceDDPStrategy ("ddp_explicit") against stock DDPStrategy, on 2 gloo CPU processes.

One module-scoped run (``tests/strategies/parity_worker.py`` as two ranks, all fits sharing one process group)
trains a tiny BatchNorm model per case under ``ddp``, ``per_parameter`` and ``bucketed``; the tests compare
the saved parameters *and* buffers bit for bit, rank by rank.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import mm_lightning.config_parser  # noqa: F401  (registers ddp_explicit, ddp_explicit_spawn)
from mm_lightning.extras import ExplicitAllReduceDDPStrategy
from mm_lightning.extras.explicit_allreduce.reducers import assign_buckets
from tests.strategies.launch import run_ranks
from tests.strategies.parity_worker import CASES, CONTROL_CASE

RANKS = (0, 1)
BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parity")
    results = run_ranks(["tests/strategies/parity_worker.py", str(out)], log_dir=out, timeout=400)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.output[-4000:]}"
    return out


def load(parity_dir: Path, case: str, variant: str, rank: int) -> dict[str, Any]:
    return torch.load(parity_dir / case / f"{variant}_rank{rank}.pt")


def mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}


def test_registered_with_explicit_signature() -> None:
    assert type(StrategyRegistry.get("ddp_explicit")) is ExplicitAllReduceDDPStrategy
    assert StrategyRegistry["ddp_explicit_spawn"]["init_params"] == {"start_method": "spawn"}
    params = inspect.signature(ExplicitAllReduceDDPStrategy.__init__).parameters
    # jsonargparse builds --trainer.strategy.* from this signature; a **kwargs would expose every DDP argument.
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert params["mode"].default == "bucketed" and params["bucket_cap_mb"].default == 25.0
    with pytest.raises(ValueError, match="mode must be"):
        ExplicitAllReduceDDPStrategy(mode="ring")  # type: ignore[arg-type]


def test_bucket_assignment() -> None:
    params = [
        torch.zeros(100),  # 400 B
        torch.zeros(100, dtype=torch.float16),  # 200 B, other dtype
        torch.zeros(150),  # 600 B
        torch.zeros(1000),  # 4000 B, larger than the cap
        torch.zeros(50),  # 200 B
        torch.zeros(10),  # 40 B
    ]
    buckets = assign_buckets(params, cap_bytes=1000)
    # Reverse order, capped per bucket, dtypes never mixed, the oversize parameter alone, every index once.
    assert buckets == [[5, 4], [3], [2, 0], [1]]
    for bucket in buckets:
        assert len({params[i].dtype for i in bucket}) == 1
        assert len(bucket) == 1 or sum(params[i].numel() * params[i].element_size() for i in bucket) <= 1000


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["per_parameter", "bucketed", "bucketed_overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_bit_exact_with_ddp(parity_dir: Path, case: str, variant: str) -> None:
    for rank in RANKS:
        ours, ddp = load(parity_dir, case, variant, rank), load(parity_dir, case, "ddp", rank)
        assert ours["global_step"] == ddp["global_step"] >= 4
        # Parameters and buffers (BatchNorm running stats, which DDP re-broadcasts from rank 0) both match.
        assert mismatches(ours["state"], ddp["state"]) == {}, f"rank {rank}"
        assert ours["grads_none"] == ddp["grads_none"]
        assert ours["scales"] == ddp["scales"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ddp", "per_parameter", "bucketed", "bucketed_overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_hold_identical_parameters(parity_dir: Path, case: str, variant: str) -> None:
    rank0, rank1 = (load(parity_dir, case, variant, rank)["state"] for rank in RANKS)
    # BatchNorm buffers legitimately differ per rank after the last local forward (as under DDP).
    params = [k for k in rank0 if not k.endswith(BN_BUFFERS)]
    assert len(params) >= 8
    assert [k for k in params if not torch.equal(rank0[k], rank1[k])] == []


@pytest.mark.slow
def test_control_without_reduction_differs(parity_dir: Path) -> None:
    for rank in RANKS:
        diff = mismatches(load(parity_dir, CONTROL_CASE, "no_reduce", rank)["state"],
                          load(parity_dir, CONTROL_CASE, "ddp", rank)["state"])  # fmt: skip
        assert "body.0.weight" in diff and diff["body.0.weight"] > 1e-4
    rank0, rank1 = (load(parity_dir, CONTROL_CASE, "no_reduce", rank)["state"] for rank in RANKS)
    assert not torch.equal(rank0["body.0.weight"], rank1["body.0.weight"])


@pytest.mark.slow
def test_cases_exercise_what_they_claim(parity_dir: Path) -> None:
    # Clipping (max norm 1.0) really cut the gradients it saw after the reduction.
    assert min(load(parity_dir, "accumulate_clip", "bucketed", 0)["pre_clip_grad_norms"]) > 1.0
    # The GradScaler skipped the steps where only rank 1 overflowed (scale halves twice) on both ranks.
    for rank in RANKS:
        scales = load(parity_dir, "fp16_scaler", "bucketed", rank)["scales"]
        assert scales[0] == 65536.0 and scales[-1] == 16384.0
    # Overlap really launched buckets during backward (all of them when every parameter got a gradient).
    overlapped = load(parity_dir, "fp32", "bucketed_overlap", 0)["overlapped_buckets"]
    assert len(overlapped) == 6 and min(overlapped) >= 3
    # The rank-0-only head got (averaged) gradients on rank 1 too; the never-used layer kept grad=None.
    for rank in RANKS:
        none = load(parity_dir, "one_rank_param", "per_parameter", rank)["grads_none"]
        assert none == ["never_used.bias", "never_used.weight"]


@pytest.mark.slow
def test_manual_optimization_without_reduce_fails_loudly(parity_dir: Path) -> None:
    for rank in RANKS:
        message = (parity_dir / f"forgotten_manual_reduce_rank{rank}.txt").read_text()
        assert "reduce_gradients(optimizer)" in message
