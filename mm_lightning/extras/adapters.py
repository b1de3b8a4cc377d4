"""Parameter-efficient fine-tuning of the towers with ``peft`` (LoRA unless the options name another ``peft_type``):
only the adapters train; merged back into plain weights for export.

    model:
      adapters:
        class_path: mm_lightning.extras.PeftAdapters
        init_args:
          text: {r: 8, lora_alpha: 16}
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mm_lightning.models.rules import TowerAdapters
from mm_lightning.models.towers.contract import Kind, TowerContractError, checked_layer_groups, class_path_of
from mm_lightning.models.towers.optional import require


def default_targets(kind: Kind, tower: nn.Module) -> list[str]:
    """After the tower's first layer group (the embeddings or the stem): its Linear layers and 1x1 convolutions (the
    MLP and attention projections of a transformer, a CNN's pointwise convolutions) and its ``MultiheadAttention``
    modules, whose input and output projections peft adapts together (it cannot adapt them apart: attention calls
    them through their weights, not their ``forward``, as attention pooling does)."""
    groups = checked_layer_groups(kind, tower, f"model.adapters ({kind})")
    after_stem = {name for group in groups[1:] for name in group}
    modules = dict(tower.named_modules())
    attention = [name for name, module in modules.items() if _calls_weights_directly(module)]
    targets = []
    for name, module in modules.items():
        if any(name.startswith(f"{outer}.") for outer in attention):
            continue
        if isinstance(module, nn.MultiheadAttention) and f"{name}.in_proj_weight" in after_stem:
            targets.append(name)
        elif f"{name}.weight" in after_stem and (
            isinstance(module, nn.Linear) or isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1)
        ):
            targets.append(name)
    if not targets:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)} has no Linear layer, 1x1 convolution or MultiheadAttention after its"
            f" first layer group for an adapter: name the modules in model.adapters' {kind}.target_modules"
        )
    return targets


def _calls_weights_directly(module: nn.Module) -> bool:
    # torch's MultiheadAttention, and attention pooling (CLIP's and open_clip's ResNets) built on the same function
    return isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("AttentionPool2d")


def add_adapter(kind: Kind, tower: nn.Module, training: Any, adapter: dict[str, Any]) -> None:
    """Injects the adapter ``adapter`` describes (peft config fields) into ``tower`` in place; peft leaves only the
    adapter trainable in the tower (and the biases its ``bias`` option names). ``training``: the tower's options."""
    peft = require("peft", "peft", f"model.adapters ({kind})")
    if training.freeze or training.train_last is not None:
        raise ValueError(
            f"model.adapters adapts the {kind} tower, which trains through its adapter: drop"
            f" model.{kind}.freeze and train_last"
        )
    options = {"peft_type": "LORA", **adapter}
    if options.get("modules_to_save"):
        raise ValueError(
            f"model.adapters ({kind}): modules_to_save is not supported (export merges adapters only); train such a"
            " module outside the tower, or the whole tower"
        )
    options.setdefault("target_modules", default_targets(kind, tower))
    try:
        peft.inject_adapter_in_model(peft.get_peft_config(options), tower)
    except (ValueError, TypeError, KeyError) as err:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)}: peft cannot add the adapter {options}: {err}"
        ) from err


def merge_adapters(network: nn.Module) -> None:
    """Folds each tower's adapter into the weights it adapts (peft's ``merge``), leaving plain layers: the towers
    then have their original parameter names, for export."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for kind in ("image", "text"):
        tower = getattr(network, f"{kind}_encoder")
        merged: list[str] = []
        for name, module in list(tower.named_modules()):
            # an adapted MultiheadAttention holds its out_proj's adapter: unloading it unloads both
            if isinstance(module, BaseTunerLayer) and not any(name.startswith(f"{m}.") for m in merged):
                if hasattr(module, "unload_and_optionally_merge_module"):  # MultiheadAttention
                    plain = module.unload_and_optionally_merge_module(
                        merge=True, safe_merge=False, adapter_names=None
                    )
                else:
                    module.merge()
                    plain = module.get_base_layer()
                parent, _, attribute = name.rpartition(".")
                setattr(tower.get_submodule(parent), attribute, plain)
                merged.append(name)


class PeftAdapters(TowerAdapters):
    """peft adapters in the towers (``model.adapters``; LoRA unless an option names another ``peft_type``): only the
    adapters train in an adapted tower, and loading the network for export merges them into plain weights.

    Args:
        image: the image tower's adapter, as peft config fields (e.g. ``{r: 8, lora_alpha: 16}``; null: none).
        text: the text tower's adapter (the same)."""

    importing_options = ("megatron_core", "megatron_config")  # peft imports the module they name

    def __init__(self, image: dict[str, Any] | None = None, text: dict[str, Any] | None = None) -> None:
        self.options: dict[Kind, dict[str, Any] | None] = {"image": image, "text": text}

    def apply(self, kind: str, tower: nn.Module, training: Any) -> None:
        options = self.options[kind]  # type: ignore[index]
        if options is not None:
            add_adapter(kind, tower, training, options)  # type: ignore[arg-type]

    def merge(self, network: nn.Module) -> None:
        merge_adapters(network)
