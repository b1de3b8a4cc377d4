"""A training batch's draws depend on the run's seed, the batch's index and the rank only, and leave the process's
generators as they were (``batch_draws``: exact resume without reseeding them); each part of the step draws from
its own seed (``seed_part``), so a tower run on another process draws what it draws beside the other."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mm_lightning.models.draws import seed_part
from mm_lightning.models.module import batch_draws


def trainer_at(batch: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(fit_loop=SimpleNamespace(total_batch_idx=batch), global_rank=rank, training=True)


def drawn(batch: int, rank: int = 0) -> torch.Tensor:
    with batch_draws(trainer_at(batch, rank), torch.device("cpu")):
        return torch.rand(4)


def test_a_batch_draws_the_same_whatever_came_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    first = drawn(3)
    torch.rand(100)  # the process draws more in between (e.g. a loader's seed at an epoch's start)
    assert torch.equal(drawn(3), first)
    assert not torch.equal(drawn(4), first)  # the next batch
    assert not torch.equal(drawn(3, rank=1), first)  # another rank
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")
    assert not torch.equal(drawn(3), first)  # another run's seed


def test_the_process_generator_is_left_as_it_was() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    drawn(5)
    assert torch.equal(torch.rand(3), expected)
    # control: a reseed without the scope moves the process's stream
    torch.manual_seed(0)
    torch.manual_seed(123)
    assert not torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "trainer", [None, SimpleNamespace(fit_loop=SimpleNamespace(total_batch_idx=3), global_rank=0, training=False)],
    ids=["no-trainer", "not-training"],
)  # fmt: skip
def test_outside_a_fit_nothing_is_seeded(trainer: SimpleNamespace | None) -> None:
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    with batch_draws(trainer, torch.device("cpu")):  # type: ignore[arg-type]
        assert torch.equal(torch.rand(2), expected)


def part_drawn(part: str, rank: int = 0, for_rank: int | None = None, before: int = 0) -> torch.Tensor:
    with batch_draws(trainer_at(3, rank), torch.device("cpu")):
        torch.rand(before)  # what ran earlier in the step (the other tower)
        seed_part(part, rank=for_rank)
        return torch.rand(4)


def test_a_part_draws_the_same_whatever_ran_before_it_and_on_any_process() -> None:
    text = part_drawn("text", rank=1)
    assert torch.equal(part_drawn("text", rank=1, before=100), text)  # the image tower drew, or did not
    assert torch.equal(part_drawn("text", rank=0, for_rank=1), text)  # rank 1's rows, embedded on rank 0
    # controls: another part, another rank's rows, and the step's own stream all draw otherwise
    assert not torch.equal(part_drawn("loss", rank=1), text)
    assert not torch.equal(part_drawn("text", rank=0), text)
    with batch_draws(trainer_at(3, 1), torch.device("cpu")):
        assert not torch.equal(torch.rand(4), text)
    with pytest.raises(ValueError, match="unknown part 'fusion'"):
        part_drawn("fusion")


def test_a_part_outside_a_batch_leaves_the_generator_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    seed_part("text")
    assert torch.equal(torch.rand(2), expected)
