"""A user's own towers and losses, named by class_path: built, checked against their contracts, recorded in
checkpoints as plain data and rebuilt from them; terms combined by name."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from mm_lightning.models import MultimodalModule
from mm_lightning.models.losses import LossContractError
from mm_lightning.models.towers.contract import TowerContractError
from tests.models.helpers import make_batch, tiny_config

PARTS = "tests.template.user_parts"


def spec(name: str, **init_args: Any) -> dict[str, Any]:
    return {"class_path": f"{PARTS}.{name}", "init_args": init_args}


def user_towers(image_width: int = 12) -> dict[str, Any]:
    return tiny_config(
        image={"tower": spec("TinyPatchTower", width=image_width)},
        text={"tower": spec("TinyWordTower", width=10)},
    )


def test_user_towers_train_and_their_checkpoint_rebuilds_them() -> None:
    model = MultimodalModule(**user_towers())
    image, text = model.model.image_encoder, model.model.text_encoder
    assert type(image).__name__ == "TinyPatchTower" and type(text).__name__ == "TinyWordTower"
    # widths from one dry forward (no gradient, eval mode: BatchNorm statistics untouched)
    assert (image.pooled_dim, image.token_dim, text.pooled_dim) == (12, 12, 10)
    assert image.dry_calls == 1 and int(image.norm.num_batches_tracked) == 0
    assert model.model.image_proj.in_features == 12 and model.model.text_proj.in_features == 10
    assert model.data_config["image"]["input_size"] == (3, 32, 32)  # the default data config at image_size
    assert model.data_config["text"] == {"tokenizer": "mm-lightning/demo-bert"}
    loss = model.training_step(make_batch(captions_per_image=2), 0)
    loss.backward()
    assert torch.isfinite(loss) and image.embed.weight.grad is not None and text.embed.weight.grad is not None
    # the checkpoint records plain data: the class_path + init_args each object was built from
    hparams = dict(model.hparams)
    assert hparams["image"]["tower"] == spec("TinyPatchTower", width=12)
    torch.save(hparams, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    rebuilt = MultimodalModule(**torch.load(buffer, weights_only=True))
    rebuilt.load_state_dict(model.state_dict())  # strict: the same architecture
    model.eval(), rebuilt.eval()
    batch = make_batch()
    torch.testing.assert_close(rebuilt(batch), model(batch), rtol=0, atol=0)
    # control: a different init_args builds a different tower, which the checkpoint does not fit
    other = MultimodalModule(**user_towers(image_width=13))
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(model.state_dict())


def test_declared_widths_and_data_config_need_no_dry_forward() -> None:
    model = MultimodalModule(**tiny_config(image={"tower": spec("DeclaredWidthTower")}))
    assert model.model.image_encoder.pooled_dim == 6 and model.model.image_encoder.token_dim == 6
    config = model.data_config["image"]
    assert config["input_size"] == (3, 48, 48) and config["mean"] == (0.5, 0.5, 0.5)
    assert config["interpolation"] == "bilinear"  # a default the tower did not declare
    out, emb = model.model.encode_images(torch.zeros(2, 3, 48, 48))
    assert emb.shape == (2, 16) and out.tokens.shape == (2, 1, 6)


def test_an_object_passed_from_python_warns_that_only_its_class_is_recorded() -> None:
    from tests.template.user_parts import TinyPatchTower

    with pytest.warns(UserWarning, match="record its class but not its arguments"):
        model = MultimodalModule(**tiny_config(image={"tower": TinyPatchTower(width=12)}))
    assert model.hparams["image"]["tower"] == {"class_path": f"{PARTS}.TinyPatchTower"}
    with warnings.catch_warnings():  # control: the spec dict records everything, without a warning
        warnings.simplefilter("error")
        MultimodalModule(**user_towers())


@pytest.mark.parametrize(
    ("group", "name", "expected"),
    [
        ("image", "UnpooledTower", r"image tower tests\.template\.user_parts\.UnpooledTower: it returned a tensor "
         r"of shape \(2, 4, 4, 4\) for a batch of 2 \(pool"),
        ("image", "TupleTower", r"TupleTower: it returned a tuple\. A tower's forward\(images\) returns a \(B, D\)"),
        ("text", "IdsOnlyTower", r"text tower .*IdsOnlyTower: its forward failed on a dry batch of 2 captions of 8 "
         r"tokens: TypeError: .*forward\(input_ids, attention_mask\)"),
    ],
)  # fmt: skip
def test_a_tower_that_breaks_the_contract_is_refused_at_build_with_its_class(
    group: str, name: str, expected: str
) -> None:
    with pytest.raises(TowerContractError, match=expected):
        MultimodalModule(**tiny_config(**{group: {"tower": spec(name)}}))


def test_a_class_path_that_is_not_a_module_is_refused_naming_the_option() -> None:
    with pytest.raises(
        ValueError, match=r"model\.image\.tower: cannot build 'tests\.template\.user_parts\.NotATower'"
    ):
        MultimodalModule(**tiny_config(image={"tower": spec("NotATower")}))


def test_user_loss_terms_are_combined_by_name_logged_and_used_for_val_loss() -> None:
    config = tiny_config(loss={"itc": spec("CosineLoss", extra=0.25), "itm_weight": 0.0, "itc_weight": 2.0,
                               "term_weights": {"norm": 0.5}})  # fmt: skip
    model = MultimodalModule(**config).eval()  # no BatchNorm updates or dropout: embeddings repeat exactly
    logged: dict[str, torch.Tensor] = {}
    model.log = lambda name, value, **kw: logged.__setitem__(name, value)  # type: ignore[method-assign]
    batch = make_batch()
    loss = model.training_step(batch, 0)
    _, image_emb = model.model.encode_images(batch["image"])
    _, text_emb = model.model.encode_text(batch)
    terms = model.model.contrastive(image_emb, text_emb)
    expected = 2.0 * terms["itc"] + 0.5 * terms["norm"]
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    torch.testing.assert_close(logged["train/loss_norm"], terms["norm"], rtol=0, atol=0)
    assert "train/temperature" not in logged and "train/loss_itm" not in logged
    assert model.hparams["loss"]["itc"] == spec("CosineLoss", extra=0.25)
    # control: the weights are applied by name, so a different weight of the user's term changes the total
    other = MultimodalModule(**tiny_config(config, loss={"term_weights": {"norm": 1.5}})).eval()
    other.load_state_dict(model.state_dict())
    other.log = lambda *a, **kw: None  # type: ignore[method-assign]
    assert not torch.equal(other.training_step(batch, 0), loss)


def test_the_example_loss_feeds_the_matching_head() -> None:
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "examples" / "make_it_yours"))
    try:
        model = MultimodalModule(**tiny_config(loss={"itc": {"class_path": "my_losses.HardestNegativeHinge"},
                                                     "term_weights": {"spread": 0.1}}))  # fmt: skip
        logged: dict[str, torch.Tensor] = {}
        model.log = lambda name, value, **kw: logged.__setitem__(name, value)  # type: ignore[method-assign]
        model.training_step(make_batch(captions_per_image=2), 0).backward()
    finally:
        sys.path.remove(str(REPO / "examples" / "make_it_yours"))
    assert {"train/loss_itc", "train/loss_spread", "train/loss_itm", "train/itm_accuracy"} <= set(logged)
    assert all(p.grad is not None for p in model.model.itm.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ({"itc": spec("CosineLoss")}, r"CosineLoss: the matching head \(loss\.itm_weight > 0\) mines hard negatives"
         r" from loss_and_logits"),
        ({"itc": spec("PerPairLoss"), "itm_weight": 0.0}, r"PerPairLoss: term 'itc' is \(2,\), not a scalar tensor"),
        ({"itc": spec("CosineLoss"), "itm_weight": 0.0, "term_weights": {"itm": 1.0}}, None),
    ],
)  # fmt: skip
def test_a_loss_that_breaks_the_contract_is_refused_at_build(
    loss: dict[str, Any], expected: str | None
) -> None:
    if expected is None:
        with pytest.raises(
            ValueError, match=r"loss\.term_weights \['itm'\]: set loss\.itc_weight / loss\.itm_weight"
        ):
            MultimodalModule(**tiny_config(loss=loss))
        return
    with pytest.raises(LossContractError, match=expected):
        MultimodalModule(**tiny_config(loss=loss))


def test_the_readme_shows_the_example_files_as_they_are() -> None:
    import re

    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    start = readme.index("## Make it yours")
    section = readme[start : readme.index("\n## ", start + 1)]
    section += (REPO / "docs" / "make_it_yours.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3  # the towers (README), the loss and the callbacks (docs/make_it_yours.md)
    example = {
        name: (REPO / "examples" / "make_it_yours" / name).read_text().splitlines()
        for name in ("my_model.yaml", "mine.yaml")
    }
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        assert any(all(line in source for line in lines) for source in example.values()), block
