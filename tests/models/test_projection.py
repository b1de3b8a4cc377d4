"""``model.image.project`` / ``model.text.project`` false: a tower's pooled output is itself the shared space."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mm_lightning.models import MultimodalModule
from tests.models.helpers import make_batch, tiny_kwargs, tiny_parts

IMAGE_WIDTH, TEXT_WIDTH = 16, 32  # the tiny towers' pooled widths


def module(embed_dim: int = IMAGE_WIDTH, **groups: dict) -> MultimodalModule:
    torch.manual_seed(0)
    return MultimodalModule(**tiny_kwargs(embed_dim=embed_dim, objective={"itm_weight": 0.0}, **groups))


def test_an_unprojected_image_tower_embeds_its_pooled_output_and_the_text_head_maps_onto_it() -> None:
    model = module(image={"project": False})
    network = model.model
    assert isinstance(network.image_proj, nn.Identity)
    assert network.text_proj.in_features == TEXT_WIDTH and network.text_proj.out_features == IMAGE_WIDTH
    batch = make_batch()
    out, embedding = network.encode_images(batch["image"])
    assert torch.equal(embedding, out.pooled)
    network.train()
    _, text_embedding = network.encode_text(batch)
    network.contrastive(embedding, text_embedding, batch["image_id"]).backward()
    assert network.text_proj.weight.grad is not None and network.text_proj.weight.grad.abs().sum() > 0
    assert not any(name.startswith("image_proj") for name, _ in network.named_parameters())


def test_control_a_projected_image_tower_embeds_a_learned_map_of_it() -> None:
    network = module(image={"project": True}).model
    assert isinstance(network.image_proj, nn.Linear)
    out, embedding = network.encode_images(make_batch()["image"])
    assert embedding.shape == out.pooled.shape and not torch.equal(embedding, out.pooled)


def test_an_unprojected_text_tower_sets_the_width_the_image_head_maps_to() -> None:
    network = module(embed_dim=TEXT_WIDTH, text={"project": False}).model
    assert isinstance(network.text_proj, nn.Identity)
    assert (network.image_proj.in_features, network.image_proj.out_features) == (IMAGE_WIDTH, TEXT_WIDTH)
    out, embedding = network.encode_text(make_batch())
    assert torch.equal(embedding, out.pooled)


def test_an_embed_dim_other_than_the_towers_width_is_refused_with_the_width_to_set() -> None:
    with pytest.raises(ValueError, match=r"model.image.project false .* set model.embed_dim to 16 \(got 8\)"):
        module(embed_dim=8, image={"project": False})


def test_the_checkpointed_module_rebuilds_without_the_projection(tmp_path) -> None:
    model = module(image={"project": False})
    path = tmp_path / "m.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)
    checkpoint = torch.load(path, weights_only=False)
    # built in Python: the parts are given anew (the same tiny towers), the option groups come from the file
    again = MultimodalModule(**{**checkpoint["hyper_parameters"], **tiny_parts()})
    again.load_state_dict(checkpoint["state_dict"])  # strict: same keys, no image head
    assert isinstance(again.model.image_proj, nn.Identity)


class _TowerWithProjection(nn.Module):
    """Stands in for a tower cut out of a dual encoder (clip:, open_clip:): it brings its projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_dim = 8
        self.projection = nn.Linear(16, 8)


def test_a_tower_bringing_its_own_projection_is_refused_with_project_false() -> None:
    from mm_lightning.models.towers.contract import projection_for

    tower = _TowerWithProjection()
    with pytest.raises(
        ValueError, match=r"model.text.project is false but _TowerWithProjection brings .* dropped"
    ):
        projection_for(tower, pooled_dim=16, embed_dim=16, project=False, kind="text")
    assert hasattr(tower, "projection")  # nothing was taken from it
    # control: with project true the tower's own projection moves into the module
    projection = tower.projection
    assert projection_for(tower, pooled_dim=16, embed_dim=8, project=True) is projection
    assert not hasattr(tower, "projection")
