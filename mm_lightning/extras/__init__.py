"""The opt-in parts, each loaded only when a config or a command names it: the explicit all-reduce strategy,
gradient caching, the locked-feature cache, WebDataset shards and weighted mixes, length-grouped batches, what a
long run adds to the callbacks (NaN guard, preemption saves, exact resume), the monitors and FLOP counter, EMA,
layer-wise learning-rate decay and peft adapters. The training core never imports
them at load time (``tests/test_core_size.py``)."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "BucketedReducer": "mm_lightning.extras.explicit_allreduce.reducers",
    "CollectiveError": "mm_lightning.extras.explicit_allreduce.strategy",
    "ComplexityWeighting": "mm_lightning.extras.loss_weighting",
    "DemoShardDataModule": "mm_lightning.extras.shards.datamodule",
    "DynamicWeightAveraging": "mm_lightning.extras.loss_weighting",
    "EMA": "mm_lightning.extras.ema",
    "ExactResume": "mm_lightning.extras.exact_resume",
    "ExplicitAllReduceDDPStrategy": "mm_lightning.extras.explicit_allreduce.strategy",
    "FlopCounter": "mm_lightning.extras.flops",
    "GradNormMonitor": "mm_lightning.extras.monitors",
    "GradientCaching": "mm_lightning.extras.gradient_caching",
    "GradientReducer": "mm_lightning.extras.explicit_allreduce.reducers",
    "LayerDecay": "mm_lightning.extras.layer_decay",
    "LengthGroupedSampler": "mm_lightning.extras.length_grouping",
    "LengthGrouping": "mm_lightning.extras.length_grouping",
    "LockedImageFeatures": "mm_lightning.extras.feature_cache",
    "NaNGuard": "mm_lightning.extras.nan_guard",
    "NonFiniteTrainingError": "mm_lightning.extras.nan_guard",
    "OverlappingBucketedReducer": "mm_lightning.extras.explicit_allreduce.reducers",
    "PeakMemoryMonitor": "mm_lightning.extras.monitors",
    "PeftAdapters": "mm_lightning.extras.adapters",
    "PerParameterReducer": "mm_lightning.extras.explicit_allreduce.reducers",
    "PreemptionCheckpoint": "mm_lightning.extras.preemption",
    "RetrievalGridLogger": "mm_lightning.extras.monitors",
    "ShardDataModule": "mm_lightning.extras.shards.datamodule",
    "Source": "mm_lightning.extras.shards.datamodule",
    "StepTimeMonitor": "mm_lightning.extras.monitors",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
