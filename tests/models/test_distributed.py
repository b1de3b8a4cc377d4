"""On 2 gloo processes: the distributed contrastive loss is exact, ITM negatives come from the global batch,
and the helpers of ``mm_lightning.distributed`` gather uneven rows and average."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from mm_lightning.models import ContrastiveLoss
from tests.models import dist_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
WORLD = 2
N = dist_workers.N_PER_RANK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every case's per-rank results from one 2-process gloo run."""
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(dist_workers.worker, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return {case: [r[case] for r in per_rank] for case in per_rank[0]}


def _errors(results: list[dict]) -> dict[str, float]:
    """Max abs deviation of each distributed quantity from its single-process counterpart."""
    ref = results[0]["ref"]
    err = {"loss": 0.0, "feature_grad": 0.0, "temperature_grad": 0.0}
    for res in results:
        lo, hi = res["rows"]
        err["loss"] = max(err["loss"], (res["mean_loss"] - ref["loss"]).abs().item())
        for key in ("img", "txt"):
            # each rank's gradient is world_size x the single-process gradient of its slice
            dev = (res[f"{key}_grad"] - WORLD * ref[key][lo:hi]).abs().max().item()
            err["feature_grad"] = max(err["feature_grad"], dev)
        err["temperature_grad"] = max(
            err["temperature_grad"], (res["scale_grad"] - ref["scale"]).abs().item()
        )
    return err


def test_global_contrastive_loss_is_exact(results: dict[str, list[dict]]) -> None:
    errors = _errors(results["contrastive_global"])
    print("exactness max abs errors:", errors)
    assert all(e < 1e-6 for e in errors.values()), errors
    # the gradient is not trivially zero
    assert results["contrastive_global"][0]["img_grad"].abs().max() > 1e-3


def test_control_gather_without_grad_is_not_exact(results: dict[str, list[dict]]) -> None:
    errors = _errors(results["contrastive_no_grad_gather"])
    print("control max abs errors:", errors)
    # the loss value is the same, but the features' gradient misses the other rank's terms
    assert errors["loss"] < 1e-6
    assert errors["feature_grad"] > 1e-3


def test_local_negatives_option_scores_only_the_local_batch(results: dict[str, list[dict]]) -> None:
    img, txt, ids = dist_workers.global_batch(WORLD)
    local = results["contrastive_local"]
    for rank, res in enumerate(local):
        rows = slice(rank * N, (rank + 1) * N)
        want = ContrastiveLoss(global_negatives=False)(img[rows], txt[rows], ids[rows])
        assert res["rank_loss"].item() == pytest.approx(want.item(), abs=1e-6)
    assert abs(local[0]["mean_loss"] - local[0]["ref"]["loss"]).item() > 1e-3


def test_itm_negatives_come_from_the_global_batch_with_gradient(results: dict[str, list[dict]]) -> None:
    exact = results["itm_global"]
    # rank 1's own loss was zeroed: its token gradients can only come from rank 0 using its samples as negatives
    assert exact[1]["text_grad_norm"] > 1e-6 and exact[1]["image_grad_norm"] > 1e-6
    control = results["itm_no_grad_gather"]
    assert control[1]["text_grad_norm"] == 0 and control[1]["image_grad_norm"] == 0


def test_gather_rows_concatenates_uneven_ranks_in_order(results: dict[str, list[dict]]) -> None:
    want = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [10.0, 10.0]])
    for res in results["gather_rows"]:
        torch.testing.assert_close(res["gathered"], want)
        assert res["mean"].item() == pytest.approx(1.5)


def test_helpers_are_identities_in_one_process() -> None:
    from mm_lightning import distributed

    x = torch.randn(3, 2)
    assert distributed.world() == (0, 1)
    for fn in (distributed.gather_with_grad, distributed.gather_no_grad, distributed.gather_rows):
        assert fn(x) is x
    assert distributed.all_reduce_mean(x) is x
