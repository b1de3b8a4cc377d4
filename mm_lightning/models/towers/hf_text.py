"""Text tower over a Hugging Face ``AutoModel`` (by hub name or local directory, or built from its config)."""

from __future__ import annotations

import os
from typing import Any, Literal

from torch import Tensor
from transformers import AutoConfig, AutoModel

from mm_lightning.assets import MissingModelFolder, load_pretrained, resolve_pretrained
from mm_lightning.models.towers.contract import EncoderOutput, Tower


def _looks_like_path(name: str) -> bool:
    # hub ids are "name" or "org/name"; anything else with a separator is meant as a directory
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def load_hf(loader: Any, name: str, path: str, **kwargs: Any) -> Any:
    """``loader.from_pretrained(path)`` with errors that name the model and say how to use a local copy."""
    if _looks_like_path(path) and not os.path.isdir(os.path.expanduser(path)):
        raise MissingModelFolder(
            f"text tower {name!r}: no such local directory; pass a folder holding the model's config.json "
            "(and weights), e.g. one written by save_pretrained"
        )
    return load_pretrained(
        lambda where: loader.from_pretrained(where, **kwargs),
        os.path.expanduser(path),
        f"text tower {name!r}",
    )


# Encoders whose attention is bidirectional (every token sees every real token): their padding mask may be
# given as the 4-D mask transformers would build from it.
BIDIRECTIONAL_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert"}


def sdpa_padding_mask(model: Any, attention_mask: Tensor) -> Tensor:
    """The (B, L) padding mask as the (B, 1, L, L) boolean mask SDPA attention takes, for a bidirectional encoder.

    transformers asks ``padding_mask.all()`` of a 2-D mask (to drop the mask when nothing is padded); on a GPU
    that reads the mask back and the host waits for the device every step. A 4-D mask is used as given. Other
    models (causal text models, such an encoder configured as a decoder, other attention kernels) get the 2-D
    mask, which they need."""
    config = model.config
    bidirectional = config.model_type in BIDIRECTIONAL_ENCODERS and not getattr(config, "is_decoder", False)
    if not bidirectional or config._attn_implementation != "sdpa":
        return attention_mask
    length = attention_mask.shape[1]
    return attention_mask.bool()[:, None, None, :].expand(-1, 1, length, length)


def set_hf_gradient_checkpointing(model: Any, enabled: bool) -> None:
    """Switches a Hugging Face model's per-layer activation checkpointing (non-reentrant)."""
    # transformers >= 5.2x renamed gradient_checkpointing_* to activation_checkpointing_* (old names warn)
    if hasattr(model, "activation_checkpointing_enable"):
        enable, disable = model.activation_checkpointing_enable, model.activation_checkpointing_disable
    else:
        enable, disable = model.gradient_checkpointing_enable, model.gradient_checkpointing_disable
    if enabled:
        enable({"use_reentrant": False})
    else:
        disable()


class HFTextTower(Tower):
    """Text tower over a Hugging Face ``AutoModel``.

    Args:
        name: HF hub name or local directory (built-in names like ``mm-lightning/demo-bert`` work offline).
        pretrained: load weights (``from_pretrained``); False builds it from its config, randomly initialised.
        config_overrides: config fields to override (e.g. ``hidden_size``, ``num_hidden_layers``).
        pooling: ``cls`` (first token) or ``mean`` (mean over real tokens).
        trust_remote_code: allow code shipped with the model (off by default for safety)."""

    def __init__(
        self,
        name: str = "bert-base-uncased",
        pretrained: bool = True,
        config_overrides: dict | None = None,
        pooling: Literal["cls", "mean"] = "cls",
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise ValueError(f"text pooling must be 'cls' or 'mean', got {pooling!r}")
        path = resolve_pretrained(name)
        overrides = dict(config_overrides or {})
        if pretrained:
            self.model = load_hf(AutoModel, name, path, trust_remote_code=trust_remote_code, **overrides)
        else:
            config = load_hf(AutoConfig, name, path, trust_remote_code=trust_remote_code, **overrides)
            self.model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
        # BERT-like models carry a pooler that this tower never uses; unused parameters break DDP.
        if getattr(self.model, "pooler", None) is not None:
            self.model.pooler = None
        self.name = name
        self.pooling = pooling
        self.pooled_dim = self.token_dim = int(self.model.config.hidden_size)

    @property
    def dim(self) -> int:
        """Width of the pooled vector and of the tokens (the model's hidden size)."""
        return self.pooled_dim

    @property
    def data_config(self) -> dict[str, Any]:
        return {"tokenizer": self.name}

    @staticmethod
    def tokenizer_for(init_args: dict[str, Any]) -> str:
        """The model's own tokenizer: its name or directory (the CLI links ``data.tokenizer`` to it)."""
        return str(init_args.get("name", "bert-base-uncased"))

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        set_hf_gradient_checkpointing(self.model, enabled)

    def layer_groups(self) -> list[list[str]]:
        """Parameter names from input to output: the embeddings, each transformer layer, what follows them."""
        from mm_lightning.models.towers.layers import numbered_layer_groups

        # a layer's parameters: encoder.layer.3.*, layers.3.*, h.3.* (BERT, most encoders, GPT-2)
        return numbered_layer_groups(self, r"\.(?:layer|layers|h)\.(\d+)\.")

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> EncoderOutput:
        """Encodes (B, L) token ids; padding positions have ``attention_mask == 0``."""
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        padding = sdpa_padding_mask(self.model, attention_mask)
        states = self.model(input_ids=input_ids, attention_mask=padding, **kwargs).last_hidden_state
        mask = attention_mask.bool()
        if self.pooling == "cls":
            pooled = states[:, 0]
        else:
            weights = mask.unsqueeze(-1).to(states.dtype)
            pooled = (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return EncoderOutput(pooled=pooled, tokens=states, mask=mask)
