"""LoRA (peft) per tower from YAML (``model.adapters: PeftAdapters``): only the adapters and the heads train; export and
``DualEncoder.from_checkpoint`` give merged plain weights whose embeddings equal the adapted model's."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import transformers as hf
import yaml

from mm_lightning.cli import cli_main, main
from mm_lightning.extras.adapters import default_targets, merge_adapters
from mm_lightning.models import DualEncoder, MultimodalModule
from mm_lightning.models.towers import TorchvisionTower
from mm_lightning.models.towers.contract import TowerContractError
from tests.conftest import REPO, tiny_demo_args
from tests.models.helpers import EXACT_MODEL, TINY_MODEL, make_batch, module_kwargs, tiny_config, tiny_kwargs
from tests.towers.dual_encoders import save_tiny

LORA = {
    "adapters": {
        "class_path": "mm_lightning.extras.PeftAdapters",
        "init_args": {"image": {"r": 4, "lora_alpha": 8}, "text": {"r": 4, "lora_alpha": 8}},
    }
}


def adapters(**options: dict) -> dict:
    return {"adapters": {"class_path": "mm_lightning.extras.PeftAdapters", "init_args": options}}


def test_only_adapters_and_heads_train() -> None:
    torch.manual_seed(0)
    module = MultimodalModule(**tiny_kwargs(**LORA))
    module.trainer = pl.Trainer(max_steps=10, logger=False)  # for the schedule's length
    optimizer = module.configure_optimizers()["optimizer"]
    module.trainer = None
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    for step in range(3):
        optimizer.zero_grad()
        module.training_step(make_batch(image_size=32, seed=step), step).backward()
        optimizer.step()
    changed = {name for name, p in module.named_parameters() if not torch.equal(p, before[name])}
    in_towers = {name for name in before if ".image_encoder." in name or ".text_encoder." in name}
    assert changed & in_towers and all(".lora_" in name for name in changed & in_towers)
    assert changed - in_towers  # the projections, temperature and matching head train as usual
    # what gets an adapter: the text tower's attention and MLP projections, the image tower's 1x1 convolutions
    plain = MultimodalModule(**tiny_kwargs()).model
    targets = default_targets("text", plain.text_encoder)
    assert {t.rsplit(".", 1)[-1] for t in targets} == {"query", "key", "value", "dense"}
    assert default_targets("image", plain.image_encoder) == ["backbone.2.0.downsample.0"]
    adapted = {name.rsplit(".lora_", 1)[0] for name in changed & in_towers}
    assert adapted == {f"model.text_encoder.{t}" for t in targets} | {
        "model.image_encoder.backbone.2.0.downsample.0"
    }


def test_torch_attention_is_adapted_whole_and_merges_exactly() -> None:
    """A ViT of torch's ``MultiheadAttention`` (torchvision's): peft adapts each attention module as one (its input
    and output projections are called through their weights), never its ``out_proj`` alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(0)
    config = tiny_config(
        EXACT_MODEL, **adapters(image={"r": 4, "init_lora_weights": False})
    )  # nonzero at once
    network = MultimodalModule(**module_kwargs(config)).model.eval()
    targets = default_targets(
        "image", MultimodalModule(**module_kwargs(tiny_config(EXACT_MODEL))).model.image_encoder
    )
    assert targets == [
        f"backbone.encoder.layers.encoder_layer_0.{m}" for m in ("self_attention", "mlp.0", "mlp.3")
    ]
    assert isinstance(network.image_encoder.get_submodule(targets[0]), BaseTunerLayer)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = network.embed_images(images)
        without = copy.deepcopy(network)
        for name, p in without.named_parameters():
            if "lora_B" in name:
                p.zero_()
        base = without.embed_images(images)
        merge_adapters(network)
        got = network.embed_images(images)
    assert not any(isinstance(m, BaseTunerLayer) for m in network.modules())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (base - want).abs().max() > 1e-3  # control: the adapter is what the merged weights carry


def test_a_tower_peft_cannot_adapt_is_named() -> None:
    class Plain(TorchvisionTower):
        layer_groups = None

    tower = Plain(**TINY_MODEL["image_tower"]["init_args"])
    with pytest.raises(
        TowerContractError, match=r"Plain has no layer_groups\(\), which model.adapters \(image\) needs"
    ):
        MultimodalModule(**tiny_kwargs(image_tower=tower, **adapters(image={"r": 4})))
    with pytest.raises(
        TowerContractError, match=r"peft cannot add the adapter .*backbone.0.1"
    ):  # a BatchNorm
        MultimodalModule(**tiny_kwargs(**adapters(image={"r": 4, "target_modules": ["backbone.0.1"]})))
    with pytest.raises(ValueError, match="drop model.image.freeze and train_last"):
        MultimodalModule(**tiny_kwargs(image={"freeze": True}, **adapters(image={"r": 4})))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_fit_from_yaml_then_export_gives_the_adapted_embeddings(tmp_path: Path) -> None:
    source = tmp_path / "clip"
    reference = save_tiny("clip", source, tokenizer=True)
    overlay = tmp_path / "lora.yaml"
    overlay.write_text(yaml.safe_dump({"model": LORA}))
    args = tiny_demo_args(tmp_path, "--config", str(overlay), max_steps=3)
    args[args.index("--config") + 1] = str(REPO / "configs" / "finetune_clip.yaml")
    args += [
        "--model.image_tower.init_args.name", str(source), "--model.text_tower.init_args.name", str(source),
        "--model.embed_dim", "16", "--model.optim.lr", "1e-2", "--data.init_args.max_length", "32",
    ]  # fmt: skip
    cli_main(["fit", *args])
    checkpoint_path = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint_path, weights_only=True)["state_dict"]
    query = "model.text_encoder.model.encoder.layers.0.self_attn.q_proj"
    source_query = reference.text_model.encoder.layers[0].self_attn.q_proj.weight
    assert torch.equal(
        state[f"{query}.base_layer.weight"], source_query
    )  # the pretrained weight did not move
    assert state[f"{query}.lora_B.default.weight"].abs().max() > 0  # its adapter did

    adapted = MultimodalModule.load_from_checkpoint(checkpoint_path).model.eval()
    merged = DualEncoder.from_checkpoint(checkpoint_path).eval()
    assert not any("lora_" in name or "base_layer" in name for name, _ in merged.named_parameters())
    out = tmp_path / "exported"
    assert main(["export", "--ckpt_path", str(checkpoint_path), "--out", str(out)]) == 0
    exported = hf.AutoModel.from_pretrained(out).eval()
    batch = hf.AutoTokenizer.from_pretrained(out)(["a small red star", "a blue circle"], padding=True,
                                                  return_tensors="pt")  # fmt: skip
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = adapted.embed_text(batch["input_ids"], batch["attention_mask"]), adapted.embed_images(images)
        got = merged.embed_text(batch["input_ids"], batch["attention_mask"]), merged.embed_images(images)
        exported_text = exported.get_text_features(**batch).pooler_output
        before = reference.get_text_features(**batch).pooler_output
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    normalized = torch.nn.functional.normalize(exported_text, dim=-1)
    torch.testing.assert_close(normalized, want[0], atol=1e-5, rtol=0)
    # control: the adapters changed the embeddings, so the source directory's differ
    assert (torch.nn.functional.normalize(before, dim=-1) - want[0]).abs().max() > 1e-4


def test_rules_built_in_python_are_recorded_and_reload(tmp_path: Path) -> None:
    """A module built in Python records its rules as a config names them: its checkpoint reloads them (the adapted
    weights load into adapted towers), and export merges the adapters."""
    from mm_lightning.extras import ComplexityWeighting, DynamicWeightAveraging, LayerDecay, PeftAdapters
    from tests.models.helpers import save_checkpoint, tiny_parts

    torch.manual_seed(0)
    rules = {
        "adapters": PeftAdapters(text={"r": 4, "lora_alpha": 8}),
        "term_weighting": DynamicWeightAveraging(window=3),
        "param_groups": LayerDecay(image=0.5),
        "sample_weighting": ComplexityWeighting(),  # no arguments of its own: recorded with none
    }
    module = MultimodalModule(**tiny_kwargs(**rules))
    assert module.hparams["param_groups"] == {
        "class_path": "mm_lightning.extras.layer_decay.LayerDecay",
        "init_args": {"image": 0.5, "text": None},
    }
    path = tmp_path / "python.ckpt"
    save_checkpoint(module, path)
    reloaded = MultimodalModule.load_from_checkpoint(path, **tiny_parts())
    assert reloaded.objective.term_weighting.window == 3 and reloaded.param_group_rule.decay["image"] == 0.5
    assert type(reloaded.objective.sample_weighting).__name__ == "ComplexityWeighting"
    assert module.hparams["sample_weighting"]["init_args"] == {}
    merged = DualEncoder.from_checkpoint(path, **tiny_parts())
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    # control: the same module without its adapters record cannot take the adapted weights
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["hyper_parameters"]["adapters"]
    torch.save(checkpoint, tmp_path / "no_record.ckpt")
    with pytest.raises(RuntimeError, match="lora_"):
        DualEncoder.from_checkpoint(tmp_path / "no_record.ckpt", **tiny_parts())
