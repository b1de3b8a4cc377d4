"""The tower contract: what every tower is and what any ``nn.Module`` must do to serve as one.

A tower is an ``nn.Module`` whose ``forward(images)`` or ``forward(input_ids, attention_mask)`` returns an
:class:`EncoderOutput` (or (B, D) pooled features), with its widths and data config, read or inferred; a tower that
breaks the contract is refused when the model is built, with an error naming its class (docs/make_it_yours.md has
the details; a tower of your own is checked by :mod:`mm_lightning.models.towers.user_towers`). Also the
projections put on a pretrained tower (:func:`projection_for`).
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mm_lightning import ExplainedError
from mm_lightning.data.transforms import IMAGENET_MEAN, IMAGENET_STD


@dataclass
class EncoderOutput:
    """What a tower returns: (B, D) ``pooled``, (B, N, D_t) ``tokens``, (B, N) bool ``mask`` (True: real)."""

    pooled: Tensor
    tokens: Tensor
    mask: Tensor


class UnknownModelError(ExplainedError, ValueError):
    """A tower names a model its library does not have."""

    def __init__(self, tower: str, name: str, known: list[str], listing: str) -> None:
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"the {len(known)} it has: {listing}"
        super().__init__(f"{tower}: no model named {name!r}; {hint}")


class TowerOptionsError(ExplainedError, TypeError):
    """Constructor options a tower's model does not take (e.g. kept from the config's previous tower)."""

    def __init__(self, tower: str, name: str, kwargs: dict[str, Any], error: Exception) -> None:
        super().__init__(
            f"{tower} {name!r} does not take kwargs {sorted(kwargs)} ({error}); drop them with"
            " --model.image_tower.init_args.kwargs null, or give the model's own constructor arguments"
        )


def check_model_name(tower: str, name: str, known: list[str], listing: str) -> None:
    """Refuses a model name the library does not know, naming close ones (before the library's own error)."""
    if name not in known:
        raise UnknownModelError(tower, name, known, listing)


class Tower(nn.Module):
    """Base of the towers: subclasses set ``pooled_dim``, ``token_dim`` and define ``forward``."""

    pooled_dim: int
    token_dim: int

    @property
    def data_config(self) -> dict[str, Any]:
        """The preprocessing the weights expect (``mean``, ``std``, ``input_size``...; or ``tokenizer``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define its data_config")

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute activations in backward instead of storing them (saves memory, costs compute)."""
        raise NotImplementedError(f"{type(self).__name__} does not support gradient checkpointing")


def image_data_config(
    image_size: int,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
    interpolation: str = "bilinear",
) -> dict[str, Any]:
    """An image tower's ``data_config`` for square inputs (ImageNet statistics of 0-1 images by default)."""
    return {
        "mean": tuple(float(m) for m in mean),
        "std": tuple(float(s) for s in std),
        "input_size": (3, image_size, image_size),
        "interpolation": interpolation,
    }


WEIGHT_FILE_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")


def is_weights_file(weights: str | None) -> bool:
    """Whether ``weights`` names a local file (by suffix) rather than a library's weights name."""
    return weights is not None and weights.lower().endswith(WEIGHT_FILE_SUFFIXES)


def batchnorm_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The BatchNorm layers of ``module`` by name (any ``_BatchNorm``: 1d/2d/3d, SyncBatchNorm, timm's)."""
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


class ConfiguredTower(Tower):
    """A tower whose data config is fixed at construction (read from the weights' own files)."""

    _data_config: dict[str, Any]

    @property
    def data_config(self) -> dict[str, Any]:
        """The preprocessing the weights expect (see :class:`Tower`)."""
        return dict(self._data_config)


def projection_for(
    tower: nn.Module, pooled_dim: int, embed_dim: int, project: bool = True, kind: str = "image"
) -> nn.Module:
    """The tower's own projection (moved out of it), else a new Linear; ``nn.Identity`` if not ``project``.

    Moved so that freezing the tower (LiT) leaves it trainable and checkpoints hold it once.
    """
    projection = getattr(tower, "projection", None)
    if not project:
        if projection is not None:
            raise ValueError(
                f"model.{kind}.project is false but {type(tower).__name__} brings its pretrained projection to "
                f"{tower.embed_dim} dimensions, which would be dropped: leave model.{kind}.project true"
            )
        if pooled_dim != embed_dim:
            raise ValueError(
                f"model.{kind}.project false makes the {kind} tower's pooled output ({pooled_dim} dimensions) the "
                f"shared space: set model.embed_dim to {pooled_dim} (got {embed_dim})"
            )
        return nn.Identity()
    if projection is None:
        return nn.Linear(pooled_dim, embed_dim)
    if tower.embed_dim != embed_dim:
        raise ValueError(
            f"{type(tower).__name__} brings its pretrained projection to {tower.embed_dim} dimensions; set "
            f"model embed_dim to {tower.embed_dim} (got {embed_dim})"
        )
    del tower.projection
    return projection


@torch.no_grad()
def take_over_logit_scale(loss: nn.Module, *towers: nn.Module) -> None:
    """Copies a pretrained source's learned logit scale (and bias) into the loss, when a tower carries one."""
    source = next((t for t in towers if getattr(t, "logit_scale", None) is not None), None)
    if source is None:
        return
    scale = getattr(loss, "logit_scale", None)
    if isinstance(scale, torch.Tensor):
        scale.fill_(min(source.logit_scale, getattr(loss, "max_log_scale", math.inf)))
    bias = getattr(loss, "logit_bias", None)
    if isinstance(bias, torch.Tensor) and getattr(source, "logit_bias", None) is not None:
        bias.fill_(source.logit_bias)


Kind = Literal["image", "text"]


class TowerContractError(ExplainedError, ValueError):
    """A user's tower does not do what the tower contract (:mod:`mm_lightning.models.towers.contract`) asks."""


def class_path_of(obj: Any) -> str:
    """``module.QualName`` of an object's class (how configs name it)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def contract_problem(kind: Kind, tower: nn.Module, what: str) -> TowerContractError:
    signature = "forward(images)" if kind == "image" else "forward(input_ids, attention_mask)"
    return TowerContractError(
        f"{kind} tower {class_path_of(tower)}: {what}. A tower's {signature} returns a (B, D) tensor of pooled "
        "features or an EncoderOutput(pooled, tokens, mask) (the tower contract: "
        "mm_lightning/models/towers/contract.py)"
    )


def as_encoder_output(out: Tensor | EncoderOutput) -> EncoderOutput:
    """A tower's return value (checked when the network was built) as an :class:`EncoderOutput`: pooled
    features alone are their own single token."""
    if isinstance(out, EncoderOutput):
        return out
    if not isinstance(out, Tensor):  # e.g. a tower that returns something else in train mode than in eval
        raise TowerContractError(
            f"a tower returned a {type(out).__name__} in training, not a (B, D) tensor or an EncoderOutput (the"
            " tower contract: mm_lightning/models/towers/contract.py)"
        )
    return EncoderOutput(
        out, out[:, None, :], torch.ones(out.shape[0], 1, dtype=torch.bool, device=out.device)
    )


def checked_encoder_output(kind: Kind, tower: nn.Module, out: Any, batch_size: int) -> EncoderOutput:
    """A tower's return value as an :class:`EncoderOutput`, checked against the contract."""
    if isinstance(out, EncoderOutput):
        pooled, tokens, mask = out.pooled, out.tokens, out.mask
        if not all(isinstance(t, Tensor) for t in (pooled, tokens, mask)):
            raise contract_problem(kind, tower, "its EncoderOutput holds something other than tensors")
        if pooled.dim() != 2 or tokens.dim() != 3 or mask.shape != tokens.shape[:2]:
            raise contract_problem(
                kind,
                tower,
                f"its EncoderOutput has pooled {tuple(pooled.shape)}, tokens {tuple(tokens.shape)} and mask "
                f"{tuple(mask.shape)}; expected (B, D), (B, N, D_tokens) and (B, N)",
            )
        if pooled.shape[0] != batch_size or tokens.shape[0] != batch_size:
            raise contract_problem(
                kind, tower, f"it returned {pooled.shape[0]} rows for a batch of {batch_size}"
            )
        return out
    if not isinstance(out, Tensor):
        raise contract_problem(kind, tower, f"it returned a {type(out).__name__}")
    if out.dim() != 2 or out.shape[0] != batch_size:
        hint = " (pool the spatial or sequence dimensions first)" if out.dim() > 2 else ""
        raise contract_problem(
            kind, tower, f"it returned a tensor of shape {tuple(out.shape)} for a batch of {batch_size}{hint}"
        )
    return as_encoder_output(out)


def takes_token_type_ids(tower: nn.Module) -> bool:
    """Whether a text tower's ``forward`` accepts ``token_type_ids`` (by name, or through ``**kwargs``)."""
    if isinstance(tower, Tower):
        return True
    try:
        parameters = inspect.signature(tower.forward).parameters
    except (TypeError, ValueError):
        return False
    return "token_type_ids" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def call_text_tower(
    tower: nn.Module, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None, types: bool
) -> Any:
    """Runs a text tower with the arguments its ``forward`` takes."""
    if types and token_type_ids is not None:
        return tower(input_ids, attention_mask, token_type_ids=token_type_ids)
    return tower(input_ids, attention_mask)


def data_config_of(tower: nn.Module) -> dict[str, Any]:
    """The tower's data config (a built-in tower's own, or the one ``adopt_tower`` completed)."""
    adopted = getattr(tower, "mm_lightning_data_config", None)
    return adopted if adopted is not None else tower.data_config


def set_gradient_checkpointing(kind: Kind, tower: nn.Module, enabled: bool) -> None:
    """Switches a tower's gradient checkpointing, or says which tower cannot."""
    method = getattr(tower, "set_gradient_checkpointing", None)
    if method is None:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)} has no set_gradient_checkpointing(enabled); add it (e.g. with "
            "torch.utils.checkpoint) or set model.gradient_checkpointing false"
        )
    method(enabled)


def checked_layer_groups(kind: Kind, tower: nn.Module, option: str) -> list[list[str]]:
    """``tower.layer_groups()``: its parameter names in groups, input to output (the ``option`` named needs them)."""
    method = getattr(tower, "layer_groups", None)
    if method is None:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)} has no layer_groups(), which {option} needs (the "
            "parameter names in groups from input to output; the built-in towers have it); add it or drop the option"
        )
    groups = method()
    unknown = sorted(
        {name for group in groups for name in group} - {name for name, _ in tower.named_parameters()}
    )
    if unknown:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)}: layer_groups() names no parameter {unknown[:3]}"
        )
    return groups


def train_last_groups(kind: Kind, tower: nn.Module, count: int) -> None:
    """Locks all but the tower's last ``count`` layer groups."""
    groups = checked_layer_groups(kind, tower, f"model.{kind}.train_last")
    if not 1 <= count <= len(groups):
        raise ValueError(
            f"model.{kind}.train_last must be between 1 and {len(groups)} (the layer groups of "
            f"{class_path_of(tower)}), got {count}"
        )
    parameters = dict(tower.named_parameters())
    tower.requires_grad_(False)
    for group in groups[-count:]:
        for name in group:
            parameters[name].requires_grad_(True)


def keep_locked_layers_in_eval(tower: nn.Module) -> None:
    """Eval mode for every layer whose own parameters are all locked (BatchNorm statistics stay as trained)."""
    for module in tower.modules():
        own = list(module.parameters(recurse=False))
        if own and not any(p.requires_grad for p in own):
            module.eval()
