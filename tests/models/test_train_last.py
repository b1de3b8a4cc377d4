"""Fine-tuning the top of an image tower: ``model.image.train_last`` trains its last layer groups only."""

from __future__ import annotations

import pytest
import torch

from mm_lightning.models import MultimodalModule
from tests.models.helpers import TINY_MODEL, make_batch, module_kwargs, tiny_config, tiny_kwargs

pytest.importorskip("timm")

TIMM = {  # groups: stem, layer1..layer4
    "class_path": "mm_lightning.models.towers.TimmTower",
    "init_args": {"name": "resnet10t", "image_size": 32, "kwargs": {}},
}


def module(**image: object) -> MultimodalModule:
    torch.manual_seed(0)
    return MultimodalModule(**tiny_kwargs(image_tower=TIMM, image=image, objective={"itm_weight": 0.0}))


def bn_statistics(tower: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tower.state_dict().items() if k.endswith("running_mean")}


def test_only_the_last_groups_get_gradients_and_their_batchnorm_statistics_move() -> None:
    model = module(train_last=2)
    tower = model.model.image_encoder
    groups = tower.layer_groups()
    assert len(groups) == 5  # stem, 4 stages
    trainable = {name for name, p in tower.named_parameters() if p.requires_grad}
    assert trainable == set(groups[-2] + groups[-1])
    model.train()
    before = bn_statistics(tower)
    model.training_step(make_batch(image_size=32), 0).backward()
    for name, p in tower.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    after = bn_statistics(tower)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith(("model.layer3", "model.layer4")) for k in moved), sorted(moved)


def test_control_the_whole_tower_trains_without_it() -> None:
    model = module()
    tower = model.model.image_encoder
    model.train()
    before = bn_statistics(tower)
    model.training_step(make_batch(image_size=32), 0)
    after = bn_statistics(tower)
    assert all(p.requires_grad for p in tower.parameters())
    assert all(not torch.equal(before[k], after[k]) for k in before)  # stem's statistics move too


@pytest.mark.parametrize("count", [0, 6])
def test_a_count_outside_the_groups_is_refused(count: int) -> None:
    with pytest.raises(ValueError, match=r"train_last must be between 1 and 5 .*got " + str(count)):
        module(train_last=count)


def test_train_last_with_freeze_is_refused() -> None:
    with pytest.raises(ValueError, match="set one"):
        module(train_last=1, freeze=True)


def test_the_text_tower_trains_its_last_layers_only() -> None:
    torch.manual_seed(0)
    overrides = TINY_MODEL["text_tower"]["init_args"]["config_overrides"] | {"num_hidden_layers": 3}
    config = tiny_config(
        objective={"itm_weight": 0.0}, text={"train_last": 2}, text_tower={"config_overrides": overrides}
    )
    model = MultimodalModule(**module_kwargs(config))
    tower = model.model.text_encoder
    groups = tower.layer_groups()
    assert [g[0].split(".")[1:4] for g in groups[1:]] == [["encoder", "layer", str(i)] for i in range(3)]
    assert all(".embeddings." in name for name in groups[0])
    model.train()
    model.training_step(make_batch(), 0).backward()
    trained = {name for name, p in tower.named_parameters() if p.grad is not None}
    assert trained == set(groups[-1] + groups[-2])
    assert all(".layer.1." in n or ".layer.2." in n for n in trained)
    # control: without it every layer, the embeddings included, gets a gradient
    whole = MultimodalModule(**module_kwargs(tiny_config(config, text={"train_last": None})))
    whole.training_step(make_batch(), 0).backward()
    assert all(p.grad is not None for p in whole.model.text_encoder.parameters() if p.requires_grad)
    assert any(
        ".embeddings." in n for n, p in whole.model.text_encoder.named_parameters() if p.grad is not None
    )
