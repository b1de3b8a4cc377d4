"""Training strategies. Importing this package registers ``ddp_explicit`` (and ``ddp_explicit_spawn``) in
Lightning's StrategyRegistry; the strategy's modules load only when a run uses it."""

from __future__ import annotations

import json
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from mm_lightning import lazy_exports

_EXPORTS = {
    "BucketedReducer": "mm_lightning.strategies.reducers",
    "CollectiveError": "mm_lightning.strategies.explicit_ddp",
    "ExplicitAllReduceDDPStrategy": "mm_lightning.strategies.explicit_ddp",
    "GradientReducer": "mm_lightning.strategies.reducers",
    "OverlappingBucketedReducer": "mm_lightning.strategies.reducers",
    "PerParameterReducer": "mm_lightning.strategies.reducers",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

EXPLICIT_ALL_REDUCE = "mm_lightning.strategies.ExplicitAllReduceDDPStrategy"


def explicit_all_reduce(**init_params: Any) -> Any:
    """The registry's constructor for ``ddp_explicit``: imports the strategy when a run names it."""
    from mm_lightning.strategies.explicit_ddp import ExplicitAllReduceDDPStrategy

    return ExplicitAllReduceDDPStrategy(**init_params)


explicit_all_reduce.class_path = EXPLICIT_ALL_REDUCE  # type: ignore[attr-defined]  (what the CLI expands the name to)

for _name, _start_method in (("ddp_explicit", "popen"), ("ddp_explicit_spawn", "spawn")):
    StrategyRegistry.register(
        _name,
        explicit_all_reduce,
        description=f"DDP with an explicit gradient all-reduce, start_method '{_start_method}'",
        override=True,
        start_method=_start_method,
    )


def expand_strategy_name(args: list[str]) -> list[str]:
    """With ``--trainer.strategy.<option>`` given, turn ``--trainer.strategy <registry name>`` into its class
    (plus the registry entry's options): jsonargparse takes nested options only under a class."""
    if not any(a.startswith("--trainer.strategy.") for a in args):
        return args
    out: list[str] = []
    i = 0
    while i < len(args):
        arg, name = args[i], None
        if arg == "--trainer.strategy" and i + 1 < len(args):
            name, i = args[i + 1], i + 2
        elif arg.startswith("--trainer.strategy="):
            name, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        if name not in StrategyRegistry:
            out += ["--trainer.strategy", name]
            continue
        entry = StrategyRegistry[name]
        build = entry["strategy"]  # a class, or a constructor that names its class (mm_lightning.strategies)
        class_path = getattr(build, "class_path", f"{build.__module__}.{build.__qualname__}")
        out += ["--trainer.strategy", class_path]
        for key, value in entry["init_params"].items():
            out += [f"--trainer.strategy.{key}", value if isinstance(value, str) else json.dumps(value)]
    return out
