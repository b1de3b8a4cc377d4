"""One place that turns a tower name into a tower (as timm's ``create_model`` and open_clip's factory do).

Names carry a family prefix: ``"timm:vit_small_patch16_224"``, ``"hf:/models/siglip"``,
``"open_clip:ViT-B-32"``. A bare name is a torchvision backbone or a custom CPU build (image) or a Hugging Face
``AutoModel`` (text). A family registers its builder with a decorator in its own module::

    @register_image_tower("timm")
    def build(name: str, weights: str | None, image_size: int, kwargs: dict, strict: bool) -> Tower: ...

    @register_text_tower("open_clip")
    def build(name: str, pretrained: bool, config_overrides: dict, pooling: str, trust_remote_code: bool) -> Tower:
        ...

Family modules under ``mm_lightning.models.towers`` are imported on first use of their prefix (the module named
like the prefix, or in ``FAMILY_MODULES``; see :class:`~mm_lightning.models.registry.Registry`), so a missing
optional dependency only matters to users of that family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mm_lightning.models.registry import Registry
from mm_lightning.models.towers.base import Tower

Builder = TypeVar("Builder", bound=Callable[..., Tower])

# prefix -> module of mm_lightning.models.towers that registers it, where it is named otherwise
FAMILY_MODULES = {"hf": "hf_vision"}
IMAGE_TOWERS: Registry[Callable[..., Tower]] = Registry(
    "image tower family", "mm_lightning.models.towers", FAMILY_MODULES
)
TEXT_TOWERS: Registry[Callable[..., Tower]] = Registry(
    "text tower family", "mm_lightning.models.towers", FAMILY_MODULES
)
PREFIX_SEPARATOR = ":"


def register_image_tower(prefix: str) -> Callable[[Builder], Builder]:
    """Registers ``builder(name, weights, image_size, kwargs, strict) -> Tower`` for ``"<prefix>:<name>"``.

    Args:
        prefix: family prefix (e.g. ``"timm"``).
    """
    return IMAGE_TOWERS.register(prefix)


def register_text_tower(prefix: str) -> Callable[[Builder], Builder]:
    """Registers ``builder(name, pretrained, config_overrides, pooling, trust_remote_code) -> Tower``.

    Args:
        prefix: family prefix (e.g. ``"open_clip"``).
    """
    return TEXT_TOWERS.register(prefix)


def split_name(name: str) -> tuple[str | None, str]:
    """``"timm:resnet50"`` -> ``("timm", "resnet50")``; a bare name (or a Windows path) has no prefix."""
    prefix, sep, rest = name.partition(PREFIX_SEPARATOR)
    if not sep or not prefix.isidentifier():
        return None, name
    return prefix, rest


def build_image_tower(
    name: str,
    weights: str | None = None,
    image_size: int = 224,
    kwargs: dict[str, Any] | None = None,
    strict: bool = True,
) -> Tower:
    """Builds the image tower ``name`` (``"<family>:<name>"`` or a bare torchvision/custom name).

    Args:
        name: tower name, e.g. ``"resnet50"``, ``"resnet_custom"``, ``"timm:vit_small_patch16_224"``.
        weights: the family's weights name, a local weights file, or None (random init).
        image_size: input resolution.
        kwargs: extra constructor arguments of the family.
        strict: with a weights file, fail on missing or unexpected keys.
    """
    prefix, bare = split_name(name)
    if prefix is None:
        from mm_lightning.models.towers.torchvision import TorchvisionTower

        return TorchvisionTower(bare, weights, image_size, kwargs, strict)
    return IMAGE_TOWERS.lookup(prefix)(bare, weights, image_size, dict(kwargs or {}), strict)


def build_text_tower(
    name: str,
    pretrained: bool = True,
    config_overrides: dict[str, Any] | None = None,
    pooling: str = "cls",
    trust_remote_code: bool = False,
) -> Tower:
    """Builds the text tower ``name`` (``"<family>:<name>"`` or a bare Hugging Face name / directory).

    Args:
        name: tower name, e.g. ``"bert-base-uncased"``, ``"/models/minilm"``, ``"open_clip:ViT-B-32"``.
        pretrained: load the pretrained weights (False: random init from the config).
        config_overrides: config fields to override.
        pooling: ``cls`` or ``mean`` pooling of the tokens (where the family pools itself, it may ignore it).
        trust_remote_code: allow model code shipped with the weights.
    """
    prefix, bare = split_name(name)
    if prefix is None:
        from mm_lightning.models.towers.hf_text import HFTextTower

        return HFTextTower(bare, pretrained, config_overrides, pooling, trust_remote_code)  # type: ignore[arg-type]
    overrides = dict(config_overrides or {})
    return TEXT_TOWERS.lookup(prefix)(bare, pretrained, overrides, pooling, trust_remote_code)
