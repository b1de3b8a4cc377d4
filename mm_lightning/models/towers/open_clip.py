"""``OpenCLIPImageTower`` and ``OpenCLIPTextTower``: the two halves of an ``open_clip`` model with a local
checkpoint.

``<model>`` is an open_clip architecture name (``ViT-B-32``, or one registered with
``open_clip.add_model_config``) with the checkpoint given separately (``weights``), or a local directory in
open_clip's hub layout (``open_clip_config.json`` + ``open_clip_pytorch_model.bin``/``.safetensors``), loaded
through open_clip's own ``local-dir:`` factory. Nothing is downloaded.

open_clip's towers end in their projections, so here ``pooled`` is already in the shared space and
``projection`` is ``Identity``: ``tower(x).pooled`` equals ``model.encode_image`` / ``model.encode_text``. The
logit scale (and SigLIP-style bias) are the checkpoint's. open_clip's own ``SimpleTokenizer`` is converted once
into an equivalent Hugging Face ``CLIPTokenizerFast`` (same vocabulary and merges) that the data side loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mm_lightning.models.towers.contract import ConfiguredTower, EncoderOutput
from mm_lightning.models.towers.optional import require

FEATURE = "open_clip towers"


def _open_clip() -> Any:
    return require("open_clip", "open_clip", FEATURE)


def model_identifier(name: str) -> str:
    """open_clip's name for ``name``: a local directory becomes ``local-dir:<path>``."""
    path = Path(name).expanduser()
    return f"local-dir:{path}" if path.is_dir() else name


def load_open_clip(name: str, weights: str | None = None) -> nn.Module:
    """An open_clip model from an architecture name + local checkpoint, or from a local directory.

    Args:
        name: architecture name or local directory (open_clip hub layout).
        weights: local checkpoint file for an architecture name; None gives random init (directories carry
            their own weights).
    """
    open_clip = _open_clip()
    identifier = model_identifier(name)
    if weights is not None and not Path(weights).expanduser().is_file():
        raise FileNotFoundError(f"open_clip checkpoint {weights!r} does not exist")
    pretrained = None if identifier.startswith("local-dir:") else weights
    model = open_clip.create_model(
        identifier, pretrained=pretrained, require_pretrained=pretrained is not None
    )
    return model.eval()


def _logit_parameters(model: nn.Module) -> tuple[float, float | None]:
    bias = getattr(model, "logit_bias", None)
    return float(model.logit_scale.detach()), None if bias is None else float(bias.detach())


def hf_tokenizer_dir(name: str) -> str:
    """A Hugging Face tokenizer (name or directory) equivalent to the model's open_clip tokenizer.

    open_clip's byte-level BPE ``SimpleTokenizer`` is OpenAI CLIP's; its vocabulary and merges are written once
    as a ``CLIPTokenizerFast`` under ``$XDG_CACHE_HOME/mm_lightning`` (the data side only loads HF tokenizers).
    """
    open_clip = _open_clip()
    tokenizer = open_clip.get_tokenizer(model_identifier(name))
    if not isinstance(tokenizer, open_clip.tokenizer.SimpleTokenizer):  # already a Hugging Face tokenizer
        return tokenizer.tokenizer.name_or_path
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mm_lightning"
    out = cache / f"open_clip-simple-tokenizer-{len(tokenizer.encoder)}-ctx{tokenizer.context_length}"
    if not (out / "tokenizer.json").is_file():
        _write_clip_tokenizer(tokenizer, out)
    return str(out)


def _write_clip_tokenizer(tokenizer: Any, out: Path) -> None:
    from transformers import CLIPTokenizerFast

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.get)
    start, end = tokenizer.decoder[tokenizer.sot_token_id], tokenizer.decoder[tokenizer.eot_token_id]
    hf_tokenizer = CLIPTokenizerFast(
        vocab=dict(tokenizer.encoder),
        merges=[tuple(pair) for pair in merges],
        unk_token=end,
        bos_token=start,
        eos_token=end,
        pad_token=end,
        model_max_length=tokenizer.context_length,
    )
    hf_tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process wrote it first
        if not (out / "tokenizer.json").is_file():
            raise


class _OpenCLIPHalf(ConfiguredTower):
    projection: nn.Module
    pooled_dim: int
    token_dim: int

    def _take_over(self, model: nn.Module) -> None:
        self.projection = nn.Identity()  # open_clip's projections are inside the towers
        self.logit_scale, self.logit_bias = _logit_parameters(model)
        self.source_type = "open_clip"
        self.embed_dim = self.pooled_dim

    def layer_groups(self) -> list[list[str]]:
        """Parameter names from input to output: embeddings (stem), each residual block (ResNet stage), then the
        final norm, attention pooling and projection."""
        from mm_lightning.models.towers.layers import numbered_layer_groups

        return numbered_layer_groups(
            self,
            r"\.(?:resblocks|blocks|stages)\.(\d+)\.|^visual\.layer(\d+)\.",
            r"ln_post|ln_final|attnpool|\.proj$|^text_projection",
        )


class OpenCLIPImageTower(_OpenCLIPHalf):
    """The image half (``model.visual``) of an open_clip model.

    Args:
        name: architecture name or local directory.
        weights: local checkpoint for an architecture name.
    """

    def __init__(self, name: str, weights: str | None = None) -> None:
        super().__init__()
        model = load_open_clip(name, weights)
        self.visual = model.visual
        # ViT towers also return their (LayerNorm-ed) patch tokens; others give the pooled vector only
        self.has_tokens = hasattr(self.visual, "output_tokens")
        if self.has_tokens:
            self.visual.output_tokens = True
        self.pooled_dim = _embed_dim(model)
        self.token_dim = self.visual.transformer.width if self.has_tokens else self.pooled_dim
        self._take_over(model)
        cfg = _open_clip().get_model_preprocess_cfg(model)
        size = cfg["size"] if isinstance(cfg["size"], tuple | list) else (cfg["size"], cfg["size"])
        self._data_config = {
            "mean": tuple(cfg["mean"]),
            "std": tuple(cfg["std"]),
            "input_size": (3, *size),
            "interpolation": cfg["interpolation"],
            # a directory carries its weights; an architecture name without weights is random init
            "pretrained": weights is not None or Path(name).expanduser().is_dir(),
        }

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """open_clip's per-block activation checkpointing of the image tower."""
        self.visual.set_grad_checkpointing(enabled)

    def forward(self, images: Tensor) -> EncoderOutput:
        """Encodes (B, 3, H, W) normalized images; ``pooled`` equals ``model.encode_image``."""
        if self.has_tokens:
            pooled, tokens = self.visual(images)
        else:
            pooled = self.visual(images)
            tokens = pooled[:, None]
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return EncoderOutput(pooled=pooled, tokens=tokens, mask=mask)


def _embed_dim(model: nn.Module) -> int:
    with torch.no_grad():  # the width of encode_text's output, whatever the projection's type
        return int(model.encode_text(torch.zeros(1, model.context_length, dtype=torch.long)).shape[-1])


class OpenCLIPTextTower(_OpenCLIPHalf):
    """The text half of an open_clip ``CLIP`` model (token embedding, causal transformer, final LN, projection).

    Inputs shorter than the model's context length are padded with 0 (open_clip's padding) before the
    transformer, whose position embeddings have a fixed length; the causal mask keeps the padding from changing
    the real tokens.

    Args:
        name: architecture name or local directory.
        weights: local checkpoint for an architecture name.
    """

    @staticmethod
    def tokenizer_for(init_args: dict[str, Any]) -> str:
        """A Hugging Face copy of open_clip's tokenizer (the CLI links ``data.tokenizer`` to it)."""
        return hf_tokenizer_dir(str(init_args["name"]))

    def __init__(self, name: str, weights: str | None = None) -> None:
        super().__init__()
        model = load_open_clip(name, weights)
        if not hasattr(model, "token_embedding"):
            raise ValueError(
                f"open_clip model {name} has a custom text tower ({type(model).__name__}); only the standard CLIP text "
                "transformer is supported as an open_clip text tower"
            )
        self.token_embedding = model.token_embedding
        self.positional_embedding = model.positional_embedding
        self.transformer = model.transformer
        self.ln_final = model.ln_final
        self.text_projection = model.text_projection
        self.register_buffer("attn_mask", model.attn_mask, persistent=False)
        self.pool_type = model.text_pool_type
        self.eos_id = getattr(model, "text_eos_id", None)
        self.context_length: int = model.context_length
        self.token_dim = model.transformer.width
        self.pooled_dim = _embed_dim(model)
        self._take_over(model)
        self._data_config = {"tokenizer": self.tokenizer_for({"name": name})}

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """open_clip's per-block activation checkpointing of the text transformer."""
        self.transformer.grad_checkpointing = enabled

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> EncoderOutput:
        """Encodes (B, L) token ids (L <= context length); ``pooled`` equals ``model.encode_text``."""
        length = input_ids.shape[1]
        if length > self.context_length:
            raise ValueError(
                f"captions of {length} tokens exceed the model's context length {self.context_length}"
            )
        text = F.pad(input_ids, (0, self.context_length - length), value=0)
        # open_clip's CLIP.encode_text, kept apart here because it returns the pooled vector only
        open_clip = _open_clip()
        x = self.token_embedding(text) + self.positional_embedding
        x = self.ln_final(self.transformer(x, attn_mask=self.attn_mask))
        pooled = open_clip.transformer.text_global_pool(x, text, self.pool_type, eos_token_id=self.eos_id)
        if isinstance(self.text_projection, nn.Linear):
            pooled = self.text_projection(pooled)
        elif self.text_projection is not None:
            pooled = pooled @ self.text_projection
        return EncoderOutput(pooled=pooled, tokens=x[:, :length], mask=attention_mask.bool())
