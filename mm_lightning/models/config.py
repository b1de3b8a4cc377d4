"""The model's options, grouped by concern: one dataclass each for the towers, fusion, loss and optimization.

They are the types of ``MultimodalModule``'s arguments, so the command line reads them as nested groups
(``--model.image.name resnet_custom``, ``--model.optim.lr 3e-3``) and a YAML config as nested sections.
From Python, pass the dataclasses or plain dicts with the same keys.

A user's own tower or loss is an object named by ``class_path`` + ``init_args`` (``model.image.tower``,
``model.text.tower``, ``model.loss.itc``): the CLI builds it, and checkpoints store the ``class_path`` +
``init_args`` dict it was built from (plain data, loadable with ``weights_only=True``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

from torch import nn

Config = TypeVar("Config")


@dataclass(frozen=True)
class ImageTowerConfig:
    """The image tower.

    Args:
        name: tower name: a torchvision model (``resnet50``, ``vit_b_16``, ``convnext_tiny``, ...), a small CPU
            build (``resnet_custom``, ``vit_custom``), or ``"<family>:<name>"`` of a registered family.
        tower: a user's own tower instead of ``name``: any ``nn.Module`` by ``class_path`` + ``init_args``
            (contract: :mod:`mm_lightning.models.towers.contract`); ``name``, ``weights``, ``kwargs`` and
            ``strict`` are then unused.
        weights: the family's weights name (torchvision: ``IMAGENET1K_V2``, needs the hub cache offline), a local
            ``.pth``/``.safetensors`` file, or null (random init).
        kwargs: extra constructor arguments of the tower (e.g. ``widths``/``layers`` of ``resnet_custom``).
        image_size: input resolution the tower is built for; the data follows it (unless ``data.image_size`` is
            set).
        freeze: keep the tower's weights fixed (and the tower in eval mode, LiT-style).
        train_last: train only the tower's last N layer groups (its ``layer_groups()``, input to output; timm
            towers: the stem, each stage, the final layers), the earlier ones locked with their BatchNorm layers
            in eval mode: fine-tuning the top of a pretrained tower (null: the whole tower trains).
        freeze_batchnorm: keep the tower's BatchNorm layers in eval mode (their running statistics normalize,
            and are not updated; their affine weights still train). Makes gradient caching exact for a
            BatchNorm tower, and suits small per-device batches.
        project: learn a linear projection of the tower's pooled output into the shared space; false uses the
            pooled output itself as the shared space (``embed_dim`` must equal its width) and the other tower's
            projection maps onto it -- LiT's locked image tower without a head, as in big_vision's LiT configs.
        lr: learning rate of the tower (null: ``optim.lr``; 0 is a valid choice).
        clip_norm: max gradient norm of the tower (null: no per-tower clipping).
        strict: with a weights file, fail on missing or unexpected keys.
    """

    name: str = "resnet50"
    tower: nn.Module | None = None
    weights: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    image_size: int = 224
    freeze: bool = False
    train_last: int | None = None
    freeze_batchnorm: bool = False
    project: bool = True
    lr: float | None = None
    clip_norm: float | None = None
    strict: bool = True


@dataclass(frozen=True)
class TextTowerConfig:
    """The text tower (its name is also the tokenizer's: the CLI links ``data.tokenizer`` to it).

    Args:
        name: Hugging Face hub name or local directory (``mm-lightning/demo-bert`` is built in), or
            ``"<family>:<name>"`` of a registered family; it also names the tokenizer.
        tower: a user's own tower instead of the one ``name`` builds: any ``nn.Module`` by ``class_path`` +
            ``init_args`` (contract: :mod:`mm_lightning.models.towers.contract`); ``name`` then names only the
            tokenizer its input ids come from, and ``pretrained``, ``config_overrides``, ``pooling`` and
            ``trust_remote_code`` are unused.
        pretrained: load the pretrained weights; false builds the model from its config, randomly initialised.
        config_overrides: model config fields to override (e.g. ``num_hidden_layers``).
        pooling: ``cls`` (first token) or masked ``mean`` pooling of the tokens.
        trust_remote_code: allow model code shipped with the weights.
        freeze: keep the tower's weights fixed (and the tower in eval mode).
        train_last: train only the tower's last N layer groups (Hugging Face towers: the embeddings, each
            transformer layer, what follows them), the earlier ones locked (null: the whole tower trains).
        freeze_batchnorm: keep the tower's BatchNorm layers (if any) in eval mode, as for the image tower.
        project: learn a linear projection into the shared space; false uses the pooled output itself, as for
            the image tower.
        lr: learning rate of the tower (null: ``optim.lr``).
        clip_norm: max gradient norm of the tower (null: no per-tower clipping).
    """

    name: str = "bert-base-uncased"
    tower: nn.Module | None = None
    pretrained: bool = True
    config_overrides: dict[str, Any] = field(default_factory=dict)
    pooling: Literal["cls", "mean"] = "cls"
    trust_remote_code: bool = False
    freeze: bool = False
    train_last: int | None = None
    freeze_batchnorm: bool = False
    project: bool = True
    lr: float | None = None
    clip_norm: float | None = None


@dataclass(frozen=True)
class FusionConfig:
    """The cross-attention fusion feeding the image-text matching (ITM) head.

    Args:
        layers: fusion layers.
        heads: attention heads (must divide ``embed_dim``).
        bidirectional: also let the text tokens attend to the image tokens.
    """

    layers: int = 1
    heads: int = 8
    bidirectional: bool = False


@dataclass(frozen=True)
class LossConfig:
    """The training objective: an image-text pair loss (ITC) plus ITM, and how their terms are weighted.

    Args:
        name: the pair loss (``clip``; other built-in losses, e.g. ``siglip``, by name).
        itc: a user's own pair loss instead of ``name``: any ``nn.Module`` by ``class_path`` + ``init_args``
            (contract: :mod:`mm_lightning.models.losses.base`); ``temperature_init``,
            ``learnable_temperature``, ``global_negatives`` and ``kwargs`` are then unused (its own
            ``init_args`` hold its options).
        itc_weight: weight of the pair loss's ``itc`` term.
        itm_weight: weight of the ITM loss; 0 switches ITM (and the fusion module) off.
        term_weights: weights of a loss's other named terms (default 1 each), e.g. ``{uniformity: 0.1}``.
        temperature_init: initial temperature of the pair loss.
        learnable_temperature: train the temperature.
        global_negatives: under data parallelism, use the global batch as negatives (ITC and ITM).
        weighting: ``fixed`` weights, or ``dwa`` (Dynamic Weight Averaging on the losses' trend).
        dwa_window: DWA window in steps.
        dwa_temperature: DWA softmax temperature.
        sample_weighting: ``none``, or ``complexity`` (per-pair weights from image detail and caption length).
        kwargs: extra constructor arguments of the pair loss (loss-specific options).
    """

    name: str = "clip"
    itc: nn.Module | None = None
    itc_weight: float = 1.0
    itm_weight: float = 1.0
    term_weights: dict[str, float] = field(default_factory=dict)
    temperature_init: float = 0.07
    learnable_temperature: bool = True
    global_negatives: bool = True
    weighting: Literal["fixed", "dwa"] = "fixed"
    dwa_window: int = 50
    dwa_temperature: float = 2.0
    sample_weighting: Literal["none", "complexity"] = "none"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted({"itc", "itm"} & set(self.term_weights))
        if taken:
            raise ValueError(f"loss.term_weights {taken}: set loss.itc_weight / loss.itm_weight instead")


@dataclass(frozen=True)
class GradCacheConfig:
    """Exact gradient caching (:mod:`mm_lightning.models.gradcache`).

    Args:
        chunks: embed each training batch in this many chunks: the loss and gradient of the whole batch (all its
            negatives) on the activation memory of one chunk, for one extra tower forward; 1 switches it off.
    """

    chunks: int = 1


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay per step (tower learning rates live in the tower groups).

    Args:
        lr: learning rate of the new heads (projections, fusion, ITM head, temperature) and default of the towers.
        weight_decay: AdamW weight decay (biases, norms and the temperature are excluded).
        warmup_steps: linear warmup steps.
        min_lr_ratio: final LR / peak LR of the cosine decay.
        clip_heads: max gradient norm of the parameters outside the towers (null: none).
        fused: AdamW's fused kernel (one kernel per step; it also lets ``NaNGuard`` skip a step without a
            per-step host sync). Null: fused when every parameter is on a CUDA device.
    """

    lr: float = 1e-4
    weight_decay: float = 0.05
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    clip_heads: float | None = None
    fused: bool | None = None


# shared defaults of MultimodalModule's arguments (frozen, so sharing them is safe)
DEFAULT_IMAGE = ImageTowerConfig()
DEFAULT_TEXT = TextTowerConfig()
DEFAULT_FUSION = FusionConfig()
DEFAULT_LOSS = LossConfig()
DEFAULT_OPTIM = OptimConfig()
DEFAULT_GRAD_CACHE = GradCacheConfig()


# fields that hold a user's object (built from class_path + init_args)
OBJECT_FIELDS = ("tower", "itc")


def is_spec(value: Any) -> bool:
    """Whether ``value`` is a ``{"class_path": ..., "init_args": ...}`` dict."""
    return isinstance(value, dict) and isinstance(value.get("class_path"), str)


def instantiate(spec: dict[str, Any], where: str) -> nn.Module:
    """Builds the ``nn.Module`` a ``class_path`` + ``init_args`` dict names, the way LightningCLI builds its
    classes (jsonargparse: the class is imported, ``init_args`` checked against its signature).

    Args:
        spec: ``{"class_path": "pkg.mod.Class", "init_args": {...}}``.
        where: the option it came from, for messages (e.g. ``model.image.tower``).
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(nn.Module, "object", fail_untyped=False)
    try:
        config = parser.parse_object({"object": spec})
    except Exception as error:  # noqa: BLE001  (jsonargparse's reason, with the option it came from)
        raise ValueError(f"{where}: cannot build {spec.get('class_path')!r}: {error}") from error
    return parser.instantiate_classes(config).object


def as_config(cls: type[Config], value: Config | dict[str, Any] | None, group: str = "") -> Config:
    """Accepts the dataclass, a plain dict of its fields (from Python or a checkpoint), or None (defaults).

    A user's object given as a ``class_path`` + ``init_args`` dict (a checkpoint's record of it) is built here.

    Args:
        cls: the config dataclass.
        value: what the caller passed.
        group: the option group, for messages (e.g. ``model.image``).
    """
    if value is None:
        return cls()
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(known)}")
        value = cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"expected {cls.__name__} or a dict, got {type(value).__name__}")
    built = {
        name: instantiate(getattr(value, name), f"{group}.{name}" if group else name)
        for name in OBJECT_FIELDS
        if is_spec(getattr(value, name, None))
    }
    return replace(value, **built) if built else value  # type: ignore[type-var]


def as_dict(config: Any, specs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config dataclass as a plain dict (what checkpoints store: loadable with ``weights_only=True``).

    Args:
        config: a config dataclass instance.
        specs: the ``class_path`` + ``init_args`` record of each user object the config holds.
    """
    objects = {name: None for name in OBJECT_FIELDS if hasattr(config, name)}
    plain = asdict(replace(config, **objects))  # asdict would deep-copy a module
    for name in objects:
        plain[name] = (specs or {}).get(name)
    return plain


def object_specs(value: Any, config: Any, given: Any = None) -> dict[str, dict[str, Any]]:
    """The ``class_path`` + ``init_args`` record of each user object in ``config``, for its checkpoint.

    Args:
        value: what the caller passed for the group (a dict or dataclass that may hold the record itself).
        config: the group's config, with the objects built.
        given: the group as LightningCLI parsed it (``class_path`` + ``init_args`` of what the CLI built), or None.
    """
    import warnings

    from mm_lightning.models.towers.contract import class_path_of

    specs = {}
    for name in OBJECT_FIELDS:
        built = getattr(config, name, None)
        if built is None:
            continue
        passed = value.get(name) if isinstance(value, dict) else getattr(value, name, None)
        parsed = given.get(name) if isinstance(given, dict) else None
        if is_spec(passed):
            specs[name] = passed
        elif is_spec(parsed) and parsed["class_path"] == class_path_of(built):
            specs[name] = parsed
        else:
            specs[name] = {"class_path": class_path_of(built)}
            warnings.warn(
                f"{class_path_of(built)} was passed as an object, so checkpoints record its class but not its "
                "arguments; pass {'class_path': ..., 'init_args': {...}} instead to make them self-contained",
                stacklevel=3,
            )
    return specs
