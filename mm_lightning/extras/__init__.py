"""The opt-in parts, which run only when a config or a command names one (the package loads then): the explicit
all-reduce strategy, sharded data parallelism (FSDP2), modality parallelism (a group of processes per tower),
gradient caching, the locked-feature cache, WebDataset shards and weighted mixes, length-grouped batches, what a
long run adds to the callbacks (NaN guard, preemption saves, exact resume), the monitors and FLOP counter, EMA,
layer-wise learning-rate decay and peft adapters. The training core never imports them
(``tests/test_structure.py``, ``tests/test_core_size.py``)."""

from mm_lightning.extras.adapters import PeftAdapters
from mm_lightning.extras.ema import EMA
from mm_lightning.extras.exact_resume import ExactResume
from mm_lightning.extras.explicit_allreduce.reducers import (
    BucketedReducer,
    GradientReducer,
    OverlappingBucketedReducer,
    PerParameterReducer,
)
from mm_lightning.extras.explicit_allreduce.strategy import CollectiveError, ExplicitAllReduceDDPStrategy
from mm_lightning.extras.feature_cache import LockedImageFeatures
from mm_lightning.extras.flops import FlopCounter
from mm_lightning.extras.gradient_caching import GradientCaching
from mm_lightning.extras.layer_decay import LayerDecay
from mm_lightning.extras.length_grouping import LengthGroupedSampler, LengthGrouping
from mm_lightning.extras.loss_weighting import ComplexityWeighting, DynamicWeightAveraging
from mm_lightning.extras.modality_parallel import ModalityParallel
from mm_lightning.extras.monitors import (
    GradNormMonitor,
    PeakMemoryMonitor,
    RetrievalGridLogger,
    StepTimeMonitor,
)
from mm_lightning.extras.nan_guard import NaNGuard, NonFiniteTrainingError
from mm_lightning.extras.preemption import PreemptionCheckpoint
from mm_lightning.extras.sharded_training import ShardedDataParallel
from mm_lightning.extras.shards.datamodule import DemoShardDataModule, ShardDataModule, Source

__all__ = [
    "BucketedReducer",
    "CollectiveError",
    "ComplexityWeighting",
    "DemoShardDataModule",
    "DynamicWeightAveraging",
    "EMA",
    "ExactResume",
    "ExplicitAllReduceDDPStrategy",
    "FlopCounter",
    "GradNormMonitor",
    "GradientCaching",
    "GradientReducer",
    "LayerDecay",
    "LengthGroupedSampler",
    "LengthGrouping",
    "LockedImageFeatures",
    "ModalityParallel",
    "NaNGuard",
    "NonFiniteTrainingError",
    "OverlappingBucketedReducer",
    "PeakMemoryMonitor",
    "PeftAdapters",
    "PerParameterReducer",
    "PreemptionCheckpoint",
    "RetrievalGridLogger",
    "ShardDataModule",
    "ShardedDataParallel",
    "Source",
    "StepTimeMonitor",
]
