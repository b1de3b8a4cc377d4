"""Export a trained checkpoint as a model directory that ``transformers`` or ``sentence-transformers`` loads as-is.

    python -m mm_lightning export --ckpt_path logs/run/checkpoints/last.ckpt --format hf --out my-model
    python -m mm_lightning export --ckpt_path logs/lit/checkpoints/last.ckpt --format sentence-transformers --out my-lit

``--format hf`` picks one of two layouts from the towers:

- both towers from one ``CLIPModel`` / ``SiglipModel`` directory (``CLIPImageTower`` + ``CLIPTextTower``): written
  back as that class, fine-tuned towers, projections and logit scale (and bias) included, with the source
  directory's tokenizer and image processor;
- otherwise a ``VisionTextDualEncoderModel``: an image tower from Hugging Face (``HFVisionTower``: ViT, DINOv2,
  CLIP vision, SigLIP vision; or ``CLIPImageTower``) and a Hugging Face text tower (``HFTextTower``: a hub name or
  local directory such as a BERT; or ``CLIPTextTower``), with the module's projections and logit scale. The data
  pipeline's tokenizer and image normalization/size are saved next to it as a ``VisionTextDualEncoderProcessor``
  (``AutoProcessor.from_pretrained(out)``).

Either way ``get_image_features(...).pooler_output`` / ``get_text_features(...).pooler_output`` of the exported
model equal the checkpoint's projected (pre-normalization) embeddings: export checks this on a small input
(:func:`check_same_embeddings`) and refuses to write otherwise, naming the half that differs. Not expressible: text
``pooling: mean``, a DINOv2 tower with a projection bias, timm / torchvision towers.

``--format sentence-transformers`` takes what ``hf`` cannot: a timm image tower (``TimmTower``, LiT's) with an
``HFTextTower`` pooled by ``mean`` or ``cls``. It writes one ``SentenceTransformer`` directory whose ``Router`` picks
the route by input: images go through a transformers ``TimmWrapperModel`` (the timm model as trained, its
``pooler_output`` the tower's pooled vector) and a ``Dense`` layer holding the image projection, if any; text goes
through the text model, a ``Pooling`` module pooling as the tower does, and a ``Dense`` layer holding the text
projection (with its bias). ``SentenceTransformer(out).encode(images or captions)`` then gives the checkpoint's
projected (pre-normalization) embeddings of the inputs as the export prepares them: export checks this on a small
input (:func:`check_sentence_transformer`) before writing. Images are prepared by timm's evaluation transform (shorter
side resized, center crop, the data's mean and std), captions by the data's tokenizer (truncating at its
``max_length``). The loss's logit scale (and bias) go to ``logit_scale.json``: ``SentenceTransformer`` has no place
for them.

How a module becomes a ``VisionTextDualEncoderModel``: the library model computes
``visual_projection(vision_model(x).pooler_output)`` (and the same for text) with bias-free projections. The module
computes ``proj(tower(x).pooled)`` where ``proj`` is usually a Linear *with* bias, and where a BERT or ViT tower's
``pooled`` is the raw first token while the library model's ``pooler_output`` goes through its pooler
(``tanh(dense(first token))``). Each half is expressed exactly:

- models with a first-token pooler (BERT-like text models, ViT): the pooler's dense layer carries the whole
  projection ``W x + b`` in its first ``embed_dim`` rows (zeros below) and the library projection selects them.
  ViT's pooler activation is configurable and set to ``linear``. BERT's is a fixed ``tanh``: the dense layer is
  scaled by ``2**-24`` and the projection by ``2**24`` (powers of two: the scaling itself is exact), where
  ``tanh(y) == y`` to float32 precision for projection outputs up to ``4096`` in size. Such a model is meant for
  float32 (or bfloat16); float16 cannot hold the scaled values.
- models whose ``pooler_output`` already is the tower's pooled vector (CLIP / SigLIP vision and text, DINOv2):
  the projection weight is copied; a projection bias ``b`` is moved into the last bias that feeds only the pooled
  vector (CLIP vision's post-LayerNorm, SigLIP's pooling head) as ``c`` with ``W c = b`` (``embed_dim`` at most
  the tower width). DINOv2's last LayerNorm also feeds the patch tokens, so a projection bias there is refused.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, VisionTextDualEncoderConfig, VisionTextDualEncoderModel
from transformers.activations import LinearActivation

from mm_lightning import ExplainedError
from mm_lightning.checkpoints.files import sha256_of
from mm_lightning.models import DualEncoder
from mm_lightning.models.towers.clip import CLIPImageTower, CLIPTextTower, load_dual_encoder
from mm_lightning.models.towers.hf_text import HFTextTower
from mm_lightning.models.towers.hf_vision import HFVisionTower
from mm_lightning.models.towers.timm import TimmTower

log = logging.getLogger(__name__)
FORMATS = ("hf", "sentence-transformers")
SOURCE_FILE = "source_checkpoint.json"  # the checkpoint an export came from, by path and SHA-256
LOGIT_SCALE_FILE = "logit_scale.json"  # a sentence-transformers export's logit scale and bias
# relative tolerance of the embedding check (float32 rounding of reordered sums stays far below it)
TOLERANCE = 1e-5


class ExportError(ExplainedError, ValueError):
    """The checkpoint cannot be written in the requested format; the message says which part and why."""


def effective_logit_scale(loss: nn.Module) -> Tensor:
    """The (log) logit scale the loss trains with: its parameter, clamped as the loss clamps it."""
    scale = torch.as_tensor(loss.logit_scale).detach().float()
    return scale.clamp(max=getattr(loss, "max_log_scale", float("inf")))


def _single_source_directory(module: DualEncoder) -> str | None:
    """The ``CLIPModel`` / ``SiglipModel`` directory both towers came from, or None."""
    image, text = module.image_encoder, module.text_encoder
    if not (isinstance(image, CLIPImageTower) and isinstance(text, CLIPTextTower)):
        return None
    return image.name if image.name == text.name else None


@torch.no_grad()
def export_hf(module: DualEncoder, out: str | Path, data: dict[str, Any] | None = None) -> Path:
    """Writes ``module`` as a Hugging Face dual encoder directory, with tokenizer and image processor.

    Args:
        module: a trained module.
        out: output directory (created).
        data: the data module's hyperparameters the checkpoint was trained with (``images``
            with size, mean and std, ``tokenizer``, ``max_length``); missing keys follow the towers' own preprocessing.

    Returns:
        The output directory.

    Raises:
        ExportError: the towers cannot be expressed in the format, or the exported model's embeddings would
            differ from the checkpoint's (the message says which part and why).
    """
    with in_eval_mode(module):
        source_dir = _single_source_directory(module)
        if source_dir is not None:
            target = _clip_model(module, source_dir)
        else:
            target = build_dual_encoder(module)
        check_same_embeddings(module, target)
        out = Path(out)
        target.save_pretrained(out)
        if source_dir is not None:
            _copy_preprocessing(source_dir, out)
        else:
            save_processor(module, out, data or {})
    return out


@contextmanager
def in_eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (dropout off: the check compares exact embeddings), its own mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _clip_model(module: DualEncoder, source_dir: str) -> nn.Module:
    """The source ``CLIPModel`` / ``SiglipModel`` with the module's towers, projections and logit scale/bias."""
    target = load_dual_encoder(source_dir, pretrained=False).eval()
    target.vision_model.load_state_dict(module.image_encoder.model.state_dict())
    target.text_model.load_state_dict(module.text_encoder.model.state_dict())
    for name, projection in (("visual_projection", module.image_proj), ("text_projection", module.text_proj)):
        if hasattr(target, name):
            getattr(target, name).load_state_dict(projection.state_dict())
        elif not isinstance(projection, nn.Identity):
            raise ExportError(f"{type(target).__name__} has no {name} to hold the trained projection")
    target.logit_scale.copy_(effective_logit_scale(module.contrastive))
    loss_bias = getattr(module.contrastive, "logit_bias", None)
    if getattr(target, "logit_bias", None) is not None and isinstance(loss_bias, Tensor):
        target.logit_bias.copy_(loss_bias.detach())
    return target


def _copy_preprocessing(source_dir: str, out: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    from mm_lightning.assets import resolve_pretrained

    path = resolve_pretrained(source_dir)
    for loader in (AutoTokenizer, AutoImageProcessor):
        try:
            loader.from_pretrained(path).save_pretrained(out)
        except (OSError, ValueError) as err:
            log.warning("%s: no %s to copy (%s)", path, loader.__name__, err)


def _data_hyperparameters(checkpoint_path: str) -> dict[str, Any]:
    """The data module's hyperparameters stored in a Lightning checkpoint ({} when it has none)."""
    from mm_lightning.checkpoints.loading import read_checkpoint

    return dict(read_checkpoint(checkpoint_path).get("datamodule_hyper_parameters") or {})


def build_parser() -> argparse.ArgumentParser:
    """The command's options (also used by the tests that check the documented commands parse)."""
    parser = argparse.ArgumentParser(
        prog="python -m mm_lightning export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ckpt_path", required=True, help="Lightning checkpoint of a MultimodalModule")
    parser.add_argument("--format", default="hf", choices=FORMATS, help="output format (default: hf)")
    parser.add_argument("--out", required=True, help="output directory")
    return parser


def parse_checkpoint_command(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, DualEncoder]:
    """The options of a command that reads a training checkpoint (``export``, ``zeroshot``), and its network.

    A missing ``--ckpt_path`` file is a usage error naming it (exit code 2).
    """
    args = parser.parse_args(argv)
    if not Path(args.ckpt_path).exists():
        from mm_lightning.checkpoints.files import checkpoints_nearby

        # no run config here to find a run's last or best by: the file's path
        parser.error(f"--ckpt_path {args.ckpt_path!r} does not exist; {checkpoints_nearby(None)}")
    return args, DualEncoder.from_checkpoint(args.ckpt_path, map_location="cpu").eval()


def main(argv: list[str] | None = None) -> int:
    """``python -m mm_lightning export --ckpt_path CKPT --format hf|sentence-transformers --out DIR``."""
    parser = build_parser()
    args, module = parse_checkpoint_command(parser, argv)
    export = export_hf if args.format == "hf" else export_sentence_transformers
    try:
        out = export(module, args.out, _data_hyperparameters(args.ckpt_path))
    except ExportError as error:
        parser.exit(1, f"export: {args.ckpt_path}: {error}\n")
    source = {"checkpoint": str(args.ckpt_path), "checkpoint_sha256": sha256_of(args.ckpt_path)}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out} (from {source['checkpoint']}, SHA-256 {source['checkpoint_sha256']})")
    return 0


# A module as a VisionTextDualEncoderModel (the projections expressed exactly, as the docstring says);
# check_same_embeddings, below, checks both layouts

# tanh(y) rounds to y in float32 for |y| < 2**-12, so 2**-24 keeps projection outputs up to 2**12 in its linear
# range; a power of two so that scaling by it and back is exact.
TANH_SCALE = 2.0**-24
# biases that feed only the pooled vector, per model type: where a projection bias can be moved exactly
POOLED_BIAS = {
    "clip_vision_model": "post_layernorm.bias",
    "siglip_vision_model": "head.mlp.fc2.bias",
    "siglip_text_model": "head.bias",
}
SUPPORTED = (
    "image towers HFVisionTower (ViT, DINOv2, CLIP vision, SigLIP vision) or CLIPImageTower, text towers "
    "HFTextTower (hub name or local directory, e.g. BERT) or CLIPTextTower"
)


def _backbones(module: nn.Module) -> tuple[PreTrainedModel, PreTrainedModel]:
    image, text = module.image_encoder, module.text_encoder
    names = tuple(getattr(tower, "name", "(no name)") for tower in (image, text))
    if not isinstance(image, (HFVisionTower, CLIPImageTower)) or not isinstance(
        text, (HFTextTower, CLIPTextTower)
    ):
        raise ExportError(
            f"export --format hf supports {SUPPORTED}; this checkpoint has image tower {names[0]!r} "
            f"({type(image).__name__}) and text tower {names[1]!r} ({type(text).__name__})"
        )
    if isinstance(text, HFTextTower) and text.pooling != "cls":
        raise ExportError(
            f"text.pooling: {text.pooling} cannot be expressed by VisionTextDualEncoderModel, which pools text "
            "with the model's own pooler (first token); only text.pooling: cls exports"
        )
    for side, backbone in (("image", image.model), ("text", text.model)):
        if not isinstance(backbone, PreTrainedModel):
            raise ExportError(
                f"the {side} tower's model is a {type(backbone).__name__}, not a transformers model"
            )
    return image.model, text.model


def _projection_parts(projection: nn.Module, width: int) -> tuple[Tensor, Tensor]:
    """(W, b) of the module's projection; Identity is (I, 0)."""
    if isinstance(projection, nn.Identity):
        return torch.eye(width), torch.zeros(width)
    if not isinstance(projection, nn.Linear):
        raise ExportError(f"projection {type(projection).__name__} is not a Linear layer")
    weight = projection.weight.detach().float()
    bias = projection.bias.detach().float() if projection.bias is not None else torch.zeros(len(weight))
    return weight, bias


def _first_token_pooler(ours: PreTrainedModel, theirs: PreTrainedModel) -> nn.Module | None:
    """The library model's first-token pooler where our tower dropped it (its pooled is the raw first token)."""
    pooler = getattr(theirs, "pooler", None)
    if getattr(ours, "pooler", "absent") is None and isinstance(getattr(pooler, "dense", None), nn.Linear):
        return pooler
    return None


@torch.no_grad()
def _place_in_pooler(side: str, pooler: nn.Module, library: nn.Linear, weight: Tensor, bias: Tensor) -> None:
    """The projection in the pooler's dense rows; the library projection selects (and unscales) them."""
    embed_dim, width = weight.shape
    if embed_dim > width:
        raise ExportError(
            f"{side}: embed_dim {embed_dim} exceeds the tower width {width}; the {type(pooler).__name__} that "
            f"carries the projection (with its bias) is {width} wide: train with embed_dim <= {width} to export"
        )
    if isinstance(pooler.activation, (LinearActivation, nn.Identity)):
        scale = 1.0
    elif isinstance(pooler.activation, nn.Tanh):
        scale = TANH_SCALE
    else:
        raise ExportError(f"{side}: pooler activation {type(pooler.activation).__name__} is not supported")
    dense = pooler.dense
    dense.weight.zero_()
    dense.bias.zero_()
    dense.weight[:embed_dim] = weight * scale
    dense.bias[:embed_dim] = bias * scale
    library.weight.zero_()
    library.weight[:, :embed_dim] = torch.eye(embed_dim) / scale


@torch.no_grad()
def _place_projection(
    side: str, model: PreTrainedModel, library: nn.Linear, weight: Tensor, bias: Tensor
) -> None:
    """The projection weight copied; its bias moved into a bias that feeds only the pooled vector."""
    library.weight.copy_(weight)
    if not bias.any():
        return
    model_type = model.config.model_type
    carrier_name = POOLED_BIAS.get(model_type)
    if carrier_name is None:
        raise ExportError(
            f"{side}: the projection has a bias and {type(model).__name__} has no bias feeding only its pooled "
            "output to hold it (VisionTextDualEncoderModel's projections have none)"
        )
    # W c = b: c moves the bias in front of the projection, which is linear
    shift = torch.linalg.lstsq(weight.double(), bias.double()[:, None]).solution[:, 0]
    residual = float((weight.double() @ shift - bias.double()).abs().max())
    if residual > TOLERANCE * max(1.0, float(bias.abs().max())):
        raise ExportError(
            f"{side}: the projection bias is not reachable through its weight (embed_dim {len(weight)} vs "
            f"tower width {weight.shape[1]}, residual {residual:.2e}); cannot be moved into {carrier_name}"
        )
    model.get_parameter(carrier_name).add_(shift.float())


def _load_backbone(
    side: str, ours: PreTrainedModel, theirs: PreTrainedModel, pooler: nn.Module | None
) -> None:
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    allowed = {name for name, _ in pooler.named_parameters(prefix="pooler")} if pooler is not None else set()
    problems = sorted(set(missing) - allowed) + sorted(unexpected)
    if problems:
        raise ExportError(
            f"{side}: tower weights do not fit {type(theirs).__name__}: {', '.join(problems[:8])}"
        )


@torch.no_grad()
def build_dual_encoder(module: nn.Module) -> VisionTextDualEncoderModel:
    """The module's towers, projections and logit scale as a ``VisionTextDualEncoderModel``.

    Args:
        module: a ``MultimodalModule`` with supported towers (see the module docstring).

    Raises:
        ExportError: a tower or projection that the format cannot express.
    """
    image, text = _backbones(module)
    vision_config, text_config = copy.deepcopy(image.config), copy.deepcopy(text.config)
    if hasattr(vision_config, "pooler_act"):  # ViT: a linear pooler can carry the projection as is
        vision_config.pooler_act, vision_config.pooler_output_size = "linear", vision_config.hidden_size
    embed_dim = int(module.embed_dim)  # both projections end there (the module checks it)
    config = VisionTextDualEncoderConfig.from_vision_text_configs(
        vision_config,
        text_config,
        projection_dim=embed_dim,
        logit_scale_init_value=float(effective_logit_scale(module.contrastive)),
    )
    try:
        target = VisionTextDualEncoderModel(config).eval()
    except ValueError as error:  # e.g. SigLIP's text half: transformers' AutoModel cannot build it alone
        raise ExportError(
            f"VisionTextDualEncoderModel cannot build its halves from {type(vision_config).__name__} + "
            f"{type(text_config).__name__}: {str(error).splitlines()[0]}"
        ) from error
    halves = (
        ("image", image, target.vision_model, module.image_proj, target.visual_projection),
        ("text", text, target.text_model, module.text_proj, target.text_projection),
    )
    for side, ours, theirs, projection, library in halves:
        pooler = _first_token_pooler(ours, theirs)
        _load_backbone(side, ours, theirs, pooler)
        weight, bias = _projection_parts(projection, ours.config.hidden_size)
        if weight.shape[0] != embed_dim:
            raise ExportError(f"{side}: projection to {weight.shape[0]} dimensions, the other to {embed_dim}")
        if pooler is not None:
            _place_in_pooler(side, pooler, library, weight, bias)
        else:
            _place_projection(side, theirs, library, weight, bias)
    target.logit_scale.copy_(effective_logit_scale(module.contrastive))
    loss_bias = getattr(module.contrastive, "logit_bias", None)
    if isinstance(loss_bias, Tensor):
        # the library's forward has no logit bias (a sigmoid loss's): kept in the config, said out loud
        target.config.logit_bias = float(loss_bias.detach())
        log.warning(
            "the loss's logit bias %.4f is stored as config.logit_bias: VisionTextDualEncoderModel's logits "
            "do not add it (embeddings are unaffected)",
            target.config.logit_bias,
        )
    return target


def _dummy_inputs(
    module: nn.Module, target: PreTrainedModel
) -> tuple[Tensor, dict[str, Tensor], dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    side = int(module.data_config["image"]["input_size"][-1])
    images = torch.randn(2, 3, side, side, generator=generator)
    vocab = int(target.text_model.config.vocab_size)
    input_ids = torch.randint(0, vocab, (2, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = 0  # padding in one row: both sides must mask it the same way
    native = getattr(target.vision_model.config, "image_size", None)
    takes_flag = "interpolate_pos_encoding" in inspect.signature(target.vision_model.forward).parameters
    resized = takes_flag and isinstance(native, int) and native != side  # DINOv2 always interpolates
    extra = {"interpolate_pos_encoding": True} if resized else {}
    if extra:
        log.warning(
            "the image tower runs at %d px, its config at %d: call the exported model's "
            "get_image_features(pixel_values, interpolate_pos_encoding=True)",
            side,
            native,
        )
    return images, {"input_ids": input_ids, "attention_mask": attention_mask}, extra


@torch.no_grad()
def check_same_embeddings(module: nn.Module, target: PreTrainedModel) -> None:
    """Raises unless ``target``'s image and text features equal the module's projected embeddings.

    Args:
        module: the trained module (in eval mode).
        target: the Hugging Face model about to be written.

    Raises:
        ExportError: naming the half that differs and by how much.
    """
    images, text, extra = _dummy_inputs(module, target)
    device = next(module.parameters()).device  # the module may sit on a GPU; the export is built on the CPU
    on_device = {k: v.to(device) for k, v in text.items()}
    pairs = {
        "image": (
            module.encode_images(images.to(device))[1],
            target.get_image_features(pixel_values=images, **extra),
        ),
        "text": (module.encode_text(on_device)[1], target.get_text_features(**text)),
    }
    for side, (want, got) in pairs.items():
        _check_close(module, side, want, got.pooler_output, type(target).__name__)


def _check_close(module: nn.Module, side: str, want: Tensor, got: Tensor, exported: str) -> None:
    """Raises unless ``got`` equals the checkpoint's ``want`` to :data:`TOLERANCE` (relative to its largest value)."""
    want, got = want.float().cpu(), got.float().cpu()
    difference = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not difference <= TOLERANCE * max(1.0, float(want.abs().max())):
        raise ExportError(
            f"{side}: the exported {exported}'s features differ from the checkpoint's embeddings (max difference "
            f"{difference:.3g}); its {side} model pools or projects differently from the {side} tower "
            f"{getattr(getattr(module, side + '_encoder'), 'name', '(no name)')!r}"
        )


def image_preprocessing(module: nn.Module, data: dict[str, Any]) -> tuple[int, list[float], list[float]]:
    """The side, mean and std the checkpoint's images were prepared with: the data's options, else the tower's."""
    towers = module.data_config["image"]
    # data.images; a checkpoint from before the options were grouped has them at the top
    images = data.get("images") or {
        "size": data.get("image_size"),
        "mean": data.get("mean"),
        "std": data.get("std"),
    }
    side = int(images.get("size") or towers["input_size"][-1])
    mean = [float(m) for m in images.get("mean") or towers["mean"]]
    std = [float(s) for s in images.get("std") or towers["std"]]
    return side, mean, std


def save_processor(module: nn.Module, out: Path, data: dict[str, Any]) -> None:
    """Writes the tokenizer and an image processor with the training data's preprocessing, as one processor.

    The image processor does what the evaluation transform does: resize the shorter side, center crop (bilinear),
    normalize with the data's mean and std.

    Args:
        module: the trained module (its towers' preprocessing fills what ``data`` lacks).
        out: the output directory.
        data: the data module's hyperparameters (``images``' size, mean and std, ``tokenizer``, ``max_length``).
    """
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor, VisionTextDualEncoderProcessor

    from mm_lightning.assets import resolve_pretrained

    side, mean, std = image_preprocessing(module, data)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        resample=Image.Resampling.BILINEAR,
        image_mean=mean,
        image_std=std,
    )
    tokenizer_name = data.get("tokenizer") or module.data_config["text"]["tokenizer"]
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(tokenizer_name))
    if data.get("max_length"):  # the captions were truncated there in training
        tokenizer.model_max_length = int(data["max_length"])
    VisionTextDualEncoderProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)


# A module as a SentenceTransformer (--format sentence-transformers; the module docstring says how)

ST_FEATURE = "export --format sentence-transformers"
# the image route: TimmWrapperModel's pooler_output (timm's pooled features) is the route's sentence embedding
TIMM_IMAGE_ROUTE = {"image": {"method": "forward", "method_output_name": "pooler_output"}}


def _st_towers(module: nn.Module) -> tuple[TimmTower, HFTextTower]:
    image, text = module.image_encoder, module.text_encoder
    if isinstance(image, TimmTower) and isinstance(text, HFTextTower):
        return image, text
    names = tuple(getattr(tower, "name", "(no name)") for tower in (image, text))
    hint = (
        "; Hugging Face image towers export with --format hf"
        if isinstance(image, (HFVisionTower, CLIPImageTower))
        else ""
    )
    raise ExportError(
        f"{ST_FEATURE} supports image tower TimmTower with text tower HFTextTower; this checkpoint has image tower "
        f"{names[0]!r} ({type(image).__name__}) and text tower {names[1]!r} ({type(text).__name__}){hint}"
    )


def _dense(side: str, projection: nn.Module) -> list[nn.Module]:
    """The projection as a ``Dense`` module without activation (none for ``Identity``)."""
    from sentence_transformers.sentence_transformer.modules import Dense

    if isinstance(projection, nn.Identity):
        return []
    if not isinstance(projection, nn.Linear):
        raise ExportError(f"{side}: projection {type(projection).__name__} is not a Linear layer")
    dense = Dense(
        projection.in_features,
        projection.out_features,
        bias=projection.bias is not None,
        activation_function=nn.Identity(),
    )
    dense.linear.load_state_dict(projection.state_dict())
    return [dense]


def _save_timm_wrapper(tower: TimmTower, directory: Path, pretrained_cfg: dict[str, Any]) -> None:
    """The tower's timm model as a ``TimmWrapperModel`` directory, its image preprocessing in the config."""
    from transformers import TimmWrapperConfig, TimmWrapperModel

    # where timm's pretrained weights come from: the export carries its own
    model_args = {k: v for k, v in tower.create_kwargs.items() if k != "pretrained_cfg_overlay"}
    config = TimmWrapperConfig(
        architecture=tower.model.pretrained_cfg.get("architecture", tower.name),
        num_labels=0,
        model_args=model_args or None,
    )
    config.num_features = tower.pooled_dim  # the width sentence-transformers reads for timm models
    config.pretrained_cfg = pretrained_cfg  # what TimmWrapperImageProcessor builds its transform from
    wrapper = TimmWrapperModel(config)
    _load_backbone("image", tower.model, wrapper.timm_model, None)
    wrapper.save_pretrained(directory)


@torch.no_grad()
def _save_text_model(tower: HFTextTower, tokenizer: Any, directory: Path) -> None:
    """The text model (with the pooler ``HFTextTower`` drops, zeroed: unused, but loading it then reports no
    missing weights) and the tokenizer, as one directory."""
    model = tower.model
    if getattr(model, "pooler", "absent") is None:
        full = type(model)(model.config)
        _load_backbone("text", model, full, full.pooler)
        for parameter in full.pooler.parameters():
            parameter.zero_()
        model = full
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@torch.no_grad()
def build_sentence_transformer(module: nn.Module, staging: Path, data: dict[str, Any]) -> Any:
    """The module's towers and projections as a ``SentenceTransformer`` routing images and text.

    Args:
        module: a ``MultimodalModule`` with a ``TimmTower`` and an ``HFTextTower``.
        staging: an empty directory for the sub-models the ``Transformer`` modules load from.
        data: the data module's hyperparameters (``images``' size, mean and std, ``tokenizer``, ``max_length``).

    Raises:
        ExportError: towers or projections that the format cannot express.
    """
    from mm_lightning.models.towers.optional import require

    require("sentence_transformers", "sentence-transformers", ST_FEATURE)
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Router, Transformer

    from mm_lightning.data.collate import load_tokenizer
    from mm_lightning.data.transforms import INTERPOLATIONS

    image, text = _st_towers(module)
    image_dense, text_dense = _dense("image", module.image_proj), _dense("text", module.text_proj)
    side, mean, std = image_preprocessing(module, data)
    interpolation = image.data_config.get("interpolation")
    pretrained_cfg = {
        "input_size": [3, side, side],
        "mean": mean,
        "std": std,
        # as the data module resizes: the tower's interpolation where it has it, else bilinear
        "interpolation": interpolation if interpolation in INTERPOLATIONS else "bilinear",
        "crop_pct": 1.0,  # shorter side to `side`, then the central square: the evaluation crop
        "crop_mode": "center",
    }
    _save_timm_wrapper(image, staging / "image", pretrained_cfg)
    tokenizer = load_tokenizer(data.get("tokenizer") or module.data_config["text"]["tokenizer"])
    if data.get("max_length"):  # the captions were truncated there in training
        tokenizer.model_max_length = int(data["max_length"])
    _save_text_model(text, tokenizer, staging / "text")
    routes = {
        "text": [
            Transformer(str(staging / "text")),
            Pooling(text.dim, pooling_mode=text.pooling),
            *text_dense,
        ],
        "image": [
            Transformer(
                str(staging / "image"),
                modality_config=TIMM_IMAGE_ROUTE,
                module_output_name="sentence_embedding",
            ),
            *image_dense,
        ],
    }
    return SentenceTransformer(modules=[Router(routes)], device="cpu").eval()


@torch.no_grad()
def check_sentence_transformer(module: nn.Module, model: Any) -> None:
    """Raises unless ``model.encode`` of images and captions equals the module's projected embeddings of the same
    preprocessed inputs.

    Args:
        module: the trained module (in eval mode).
        model: the ``SentenceTransformer`` about to be written.

    Raises:
        ExportError: naming the half that differs and by how much.
    """
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    # two shapes, so that the check runs the resize and crop too
    pixels = [
        torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=generator)
        for h, w in ((48, 64), (64, 40))
    ]
    inputs = {
        "image": [Image.fromarray(p.numpy()) for p in pixels],
        "text": ["a photo", "two small dogs play on the grass next to a red house"],  # padding in one row
    }
    device = next(module.parameters()).device
    for side, batch in inputs.items():
        features = {k: v.to(device) for k, v in model.preprocess(batch).items() if isinstance(v, Tensor)}
        if side == "image":
            want = module.encode_images(features["pixel_values"])[1]
        else:
            want = module.encode_text(features)[1]
        got = model.encode(batch, batch_size=len(batch), convert_to_tensor=True)
        _check_close(module, side, want, got, "SentenceTransformer")


def export_sentence_transformers(
    module: DualEncoder, out: str | Path, data: dict[str, Any] | None = None
) -> Path:
    """Writes ``module`` as a ``SentenceTransformer`` directory that encodes images and captions.

    Args:
        module: a trained module with a ``TimmTower`` and an ``HFTextTower``.
        out: output directory (created).
        data: the data module's hyperparameters the checkpoint was trained with; missing keys follow the towers.

    Returns:
        The output directory.

    Raises:
        ExportError: the towers cannot be expressed in the format, or the exported model's embeddings would
            differ from the checkpoint's (the message says which part and why).
    """
    with in_eval_mode(module), tempfile.TemporaryDirectory() as staging:
        model = build_sentence_transformer(module, Path(staging), data or {})
        check_sentence_transformer(module, model)
        out = Path(out)
        model.save(str(out))
    loss = module.contrastive
    bias = getattr(loss, "logit_bias", None)
    # logits = exp(logit_scale) * cosine similarity (+ logit_bias), as the loss computed them
    scores = {
        "logit_scale": float(effective_logit_scale(loss)),
        "logit_bias": float(bias.detach()) if isinstance(bias, Tensor) else None,
    }
    (out / LOGIT_SCALE_FILE).write_text(json.dumps(scores, indent=2) + "\n", encoding="utf-8")
    return out
