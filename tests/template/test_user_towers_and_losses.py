"""A user's own towers and losses: built, checked against their contracts, named by class_path through the CLI
(recorded in checkpoints as plain data and rebuilt from them); terms combined by name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mm_lightning.cli import cli_main
from mm_lightning.models import DualEncoder, MultimodalModule
from mm_lightning.models.losses import LossContractError
from mm_lightning.models.towers.contract import TowerContractError
from tests.conftest import tiny_demo_args
from tests.models.helpers import cli_module, make_batch, save_checkpoint, tiny_config, tiny_kwargs
from tests.template import user_parts
from tests.template.user_parts import CosineLoss, TinyPatchTower, TinyWordTower

PARTS = "tests.template.user_parts"


def spec(name: str, **init_args: Any) -> dict[str, Any]:
    return {"class_path": f"{PARTS}.{name}", "init_args": init_args}


def user_towers(image_width: int = 12) -> dict[str, Any]:
    return tiny_kwargs(image_tower=TinyPatchTower(width=image_width), text_tower=TinyWordTower(width=10))


def test_user_towers_train() -> None:
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


def test_the_cli_records_user_towers_and_their_checkpoint_rebuilds_them(tmp_path: Path) -> None:
    image = spec("TinyPatchTower", width=12, patch=8, image_size=32)
    text = spec("TinyWordTower", vocab_size=36, width=10, tokenizer="mm-lightning/demo-bert")
    loss = spec("CosineLoss", extra=0.25)
    config = tiny_config(image_tower=image, text_tower=text, loss=loss, objective={"itm_weight": 0.0})
    model = cli_module(config, tmp_path / "cli")
    assert type(model.model.image_encoder).__name__ == "TinyPatchTower"
    # the checkpoint records plain data: the class_path + init_args each object was built from (Lightning's own
    # recording under the CLI)
    assert model.hparams["image_tower"] == image and model.hparams["text_tower"] == text
    assert model.hparams["loss"] == loss
    path = tmp_path / "model.ckpt"
    save_checkpoint(model, path)
    rebuilt = MultimodalModule.load_from_checkpoint(path, weights_only=True)  # strict: the same architecture
    assert type(rebuilt.model.image_encoder).__name__ == "TinyPatchTower"
    assert isinstance(rebuilt.model.contrastive, CosineLoss) and rebuilt.model.contrastive.extra == 0.25
    model.eval(), rebuilt.eval()
    batch = make_batch()
    torch.testing.assert_close(rebuilt(batch), model(batch), rtol=0, atol=0)
    # control: a different init_args builds a different tower, which the checkpoint does not fit
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"]["image_tower"] = spec("TinyPatchTower", width=13, patch=8, image_size=32)
    torch.save(checkpoint, tmp_path / "other.ckpt")
    with pytest.raises(RuntimeError, match="size mismatch"):
        MultimodalModule.load_from_checkpoint(tmp_path / "other.ckpt", weights_only=True)


def test_a_module_built_in_python_keeps_its_parts_out_of_the_checkpoint_and_takes_them_back(
    tmp_path: Path,
) -> None:
    model = MultimodalModule(**user_towers()).eval()
    path = tmp_path / "python.ckpt"
    save_checkpoint(model, path)
    hparams = torch.load(path, weights_only=True)["hyper_parameters"]  # plain data only
    assert not {"image_tower", "text_tower"} & set(hparams)
    assert not {"image_tower", "text_tower"} & set(model.hparams_initial)  # no copy of the towers kept either
    with pytest.raises(
        TypeError, match=r"unknown part\(s\) \['image_towr'\]"
    ):  # a misspelt part is no fallback
        DualEncoder.from_checkpoint(path, image_towr=TinyPatchTower(width=12))
    network = DualEncoder.from_checkpoint(
        path, image_tower=TinyPatchTower(width=12), text_tower=TinyWordTower(width=10)
    ).eval()
    batch = make_batch()
    torch.testing.assert_close(network(batch), model.model(batch), rtol=0, atol=0)
    # control: the parts passed are the ones used, so a different tower does not fit the checkpoint
    with pytest.raises(RuntimeError, match="size mismatch"):
        DualEncoder.from_checkpoint(
            path, image_tower=TinyPatchTower(width=13), text_tower=TinyWordTower(width=10)
        )


def test_declared_widths_and_data_config_are_kept_and_checked_at_build() -> None:
    model = MultimodalModule(**tiny_kwargs(image_tower=user_parts.DeclaredWidthTower()))
    assert model.model.image_encoder.pooled_dim == 6 and model.model.image_encoder.token_dim == 6
    config = model.data_config["image"]
    assert config["input_size"] == (3, 48, 48) and config["mean"] == (0.5, 0.5, 0.5)
    assert config["interpolation"] == "bilinear"  # a default the tower did not declare
    out, emb = model.model.encode_images(torch.zeros(2, 3, 48, 48))
    assert emb.shape == (2, 16) and out.tokens.shape == (2, 1, 6)
    # control: a declared width its forward does not return is refused when the network is built
    wrong = user_parts.DeclaredWidthTower()
    wrong.pooled_dim = 7
    with pytest.raises(TowerContractError, match=r"pooled_dim is 7, but its forward returns 6"):
        MultimodalModule(**tiny_kwargs(image_tower=wrong))


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
        MultimodalModule(**tiny_kwargs(**{f"{group}_tower": getattr(user_parts, name)()}))


def test_a_class_that_is_not_a_module_is_refused_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(
        TowerContractError, match=r"image tower tests\.template\.user_parts\.NotATower is not a"
    ):
        MultimodalModule(**{**tiny_kwargs(), "image_tower": user_parts.NotATower()})
    # through the CLI: a parser error that names the option and the class
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            ["fit", *tiny_demo_args(tmp_path), "--model.image_tower", f"{PARTS}.NotATower", "--print_config"]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    message = err.split("error:", 1)[1]  # after the usage line
    assert re.search(r"image_tower.*NotATower", message, re.S) and "Traceback" not in err


def user_loss(term_weight: float) -> dict[str, Any]:
    return tiny_kwargs(
        loss=CosineLoss(extra=0.25),
        objective={"itm_weight": 0.0, "itc_weight": 2.0, "term_weights": {"norm": term_weight}},
    )


def test_user_loss_terms_are_combined_by_name_logged_and_used_for_val_loss() -> None:
    # eval: no BatchNorm updates or dropout, so the embeddings repeat exactly
    model = MultimodalModule(**user_loss(0.5)).eval()
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
    assert isinstance(model.model.contrastive, CosineLoss) and model.model.contrastive.extra == 0.25
    # control: the weights are applied by name, so a different weight of the user's term changes the total
    other = MultimodalModule(**user_loss(1.5)).eval()
    other.load_state_dict(model.state_dict())
    other.log = lambda *a, **kw: None  # type: ignore[method-assign]
    assert not torch.equal(other.training_step(batch, 0), loss)


def test_the_example_loss_feeds_the_matching_head() -> None:
    import importlib
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "examples" / "make_it_yours"))
    try:
        my_losses = importlib.import_module("my_losses")
        model = MultimodalModule(
            **tiny_kwargs(loss=my_losses.HardestNegativeHinge(), objective={"term_weights": {"spread": 0.1}})
        )
        logged: dict[str, torch.Tensor] = {}
        model.log = lambda name, value, **kw: logged.__setitem__(name, value)  # type: ignore[method-assign]
        model.training_step(make_batch(captions_per_image=2), 0).backward()
    finally:
        sys.path.remove(str(REPO / "examples" / "make_it_yours"))
    assert {"train/loss_itc", "train/loss_spread", "train/loss_itm", "train/itm_accuracy"} <= set(logged)
    assert all(p.grad is not None for p in model.model.itm.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("name", "objective", "expected"),
    [
        ("CosineLoss", {}, r"CosineLoss: the matching head \(objective\.itm_weight > 0\) mines hard negatives"
         r" from loss_and_logits"),
        ("PerPairLoss", {"itm_weight": 0.0}, r"PerPairLoss: term 'itc' is \(2,\), not a scalar tensor"),
        ("CosineLoss", {"itm_weight": 0.0, "term_weights": {"itm": 1.0}}, None),
    ],
)  # fmt: skip
def test_a_loss_that_breaks_the_contract_is_refused_at_build(
    name: str, objective: dict[str, Any], expected: str | None
) -> None:
    config = tiny_kwargs(loss=getattr(user_parts, name)(), objective=objective)
    if expected is None:
        with pytest.raises(
            ValueError, match=r"objective\.term_weights \['itm'\]: set objective\.itc_weight / itm_weight"
        ):
            MultimodalModule(**config)
        return
    with pytest.raises(LossContractError, match=expected):
        MultimodalModule(**config)


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


def test_a_tower_output_that_is_not_a_tensor_in_training_is_named() -> None:
    from mm_lightning.models.towers.contract import as_encoder_output

    pooled = torch.zeros(2, 4)
    assert as_encoder_output(pooled).tokens.shape == (2, 1, 4)  # control: pooled features are their own token
    with pytest.raises(TowerContractError, match="returned a tuple in training"):
        as_encoder_output((pooled, pooled))  # type: ignore[arg-type]
