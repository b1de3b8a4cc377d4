"""Parameter-efficient fine-tuning of a tower with ``peft`` (``model.<image|text>.adapter``; LoRA unless the options
name another ``peft_type``): only the adapters train; merged back into plain weights for export."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from mm_lightning.models.towers.contract import Kind, TowerContractError, checked_layer_groups, class_path_of
from mm_lightning.models.towers.optional import require


def default_targets(kind: Kind, tower: nn.Module) -> list[str]:
    """The tower's Linear layers and 1x1 convolutions after its first layer group (the embeddings or stem): the
    attention and MLP projections of a transformer, the pointwise convolutions of a CNN."""
    groups = checked_layer_groups(kind, tower, "adapter")
    after_stem = {name for group in groups[1:] for name in group}
    targets = [
        name
        for name, module in tower.named_modules()
        if f"{name}.weight" in after_stem
        and (isinstance(module, nn.Linear) or isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1))
    ]
    if not targets:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)} has no Linear layer or 1x1 convolution after its first layer group"
            f" for an adapter: name the modules in model.{kind}.adapter.target_modules"
        )
    return targets


def add_adapter(kind: Kind, tower: nn.Module, config: Any) -> None:
    """Injects the adapter ``config.adapter`` describes (peft config fields) into ``tower`` in place; everything
    else in the tower stops training."""
    peft = require("peft", "peft", f"model.{kind}.adapter")
    from peft.tuners.tuners_utils import BaseTunerLayer

    if config.freeze or config.train_last is not None:
        raise ValueError(
            f"model.{kind}.adapter trains the tower through its adapter: drop freeze and train_last"
        )
    options = {"peft_type": "LORA", **config.adapter}
    options.setdefault("target_modules", default_targets(kind, tower))
    try:
        peft.inject_adapter_in_model(peft.get_peft_config(options), tower)
    except (ValueError, TypeError, KeyError) as err:
        raise TowerContractError(
            f"{kind} tower {class_path_of(tower)}: peft cannot add the adapter {options}: {err}"
        ) from err
    tower.requires_grad_(False)
    for module in tower.modules():
        if isinstance(module, BaseTunerLayer):
            for name in module.adapter_layer_names:
                getattr(module, name).requires_grad_(True)


def merge_adapters(network: nn.Module) -> None:
    """Folds each tower's adapter into the weights it adapts (peft's ``merge``), leaving plain layers: the towers
    then have their original parameter names, for export."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for kind in ("image", "text"):
        tower = getattr(network, f"{kind}_encoder")
        for name, module in list(tower.named_modules()):
            if isinstance(module, BaseTunerLayer):
                module.merge()
                parent, _, attribute = name.rpartition(".")
                setattr(tower.get_submodule(parent), attribute, module.get_base_layer())
        config = getattr(network, f"{kind}_config")
        setattr(network, f"{kind}_config", replace(config, adapter=None))
