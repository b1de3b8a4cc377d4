"""Training strategies. Importing this package registers ``ddp_explicit`` in Lightning's StrategyRegistry."""

from lightning.pytorch.strategies import StrategyRegistry

from mm_lightning.strategies.explicit_ddp import CollectiveError, ExplicitAllReduceDDPStrategy
from mm_lightning.strategies.reducers import (
    BucketedReducer,
    GradientReducer,
    OverlappingBucketedReducer,
    PerParameterReducer,
)

__all__ = [
    "BucketedReducer",
    "CollectiveError",
    "ExplicitAllReduceDDPStrategy",
    "GradientReducer",
    "OverlappingBucketedReducer",
    "PerParameterReducer",
]

for _name, _start_method in (("ddp_explicit", "popen"), ("ddp_explicit_spawn", "spawn")):
    StrategyRegistry.register(
        _name,
        ExplicitAllReduceDDPStrategy,
        description=f"DDP with an explicit gradient all-reduce, start_method '{_start_method}'",
        override=True,
        start_method=_start_method,
    )
