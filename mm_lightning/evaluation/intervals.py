"""How far a test figure could move on other test queries: bootstrap intervals, and the paired comparison of two
evaluations of the same test set.

The unit a bootstrap resamples is an image: in retrieval it brings all its captions (each a text -> image query)
and itself (an image -> text query), so the multi-caption structure is kept; in zero-shot classification it is one
labeled image. Every figure is then a ratio of sums over the drawn units (recall@k, top-k accuracy), or the mean of
such ratios over groups (mean per-class recall: one group per class present). SciPy's ``bootstrap`` draws the
resamples (percentile intervals). A paired comparison draws the same units for both evaluations, so the variation
the test set causes in both cancels out of their difference; a comparison of several figures at once controls the
chance that any of them is called a difference when there is none (:func:`holm_step_down`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mm_lightning.evaluation.metrics import DEFAULT_KS

METHOD = "percentile"


@dataclass(frozen=True)
class Bootstrap:
    """How intervals are drawn: ``resamples`` draws of the test set's units from ``seed``, at ``confidence``."""

    resamples: int = 1000
    seed: int = 0
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.resamples < 1:
            raise ValueError(f"bootstrap resamples must be at least 1, not {self.resamples}")
        if not 0 < self.confidence < 1:
            raise ValueError(
                f"the bootstrap confidence level must lie strictly between 0 and 1, not {self.confidence}"
            )

    def record(self, unit: str) -> dict[str, object]:
        """What a result file says of its intervals."""
        return {
            "resamples": self.resamples,
            "seed": self.seed,
            "confidence": self.confidence,
            "method": METHOD,
            "unit": unit,
        }


@dataclass
class Figures:
    """Per unit, each figure's numerator and denominator (rows: figures, columns: units); ``groups`` puts each
    unit of a figure in a group, and the figure is the mean over the groups present of their ratio of sums (one
    group: the plain ratio)."""

    names: list[str]
    numerator: np.ndarray  # (figures, units)
    denominator: np.ndarray  # (figures, units)
    groups: np.ndarray  # (figures, units), ints from 0

    def values(self) -> dict[str, float]:
        """The figures on the whole test set."""
        values = grouped_ratio(self.numerator, self.denominator, self.groups).tolist()
        return dict(zip(self.names, values, strict=True))


RETRIEVAL_UNIT = "an image with its captions"
CLASSIFICATION_UNIT = "a labeled image"


def retrieval_figures(
    t2i: np.ndarray, i2t: np.ndarray, column: np.ndarray, ks: tuple[int, ...] = DEFAULT_KS
) -> Figures:
    """Recall@k of both directions (CLIP_benchmark's names) per image, from each caption's rank of its image
    (``t2i``), each image's rank of its best caption (``i2t``) and each caption's image (``column``, a position in
    ``i2t``): the image's captions' hits over its caption count, and its own hit over 1."""
    images = len(i2t)
    captions = np.bincount(column, minlength=images).astype(np.float64)
    names, numerator, denominator = [], [], []
    for k in ks:
        names.append(f"image_retrieval_recall@{k}")
        numerator.append(np.bincount(column, weights=(t2i < k).astype(np.float64), minlength=images))
        denominator.append(captions)
    for k in ks:
        names.append(f"text_retrieval_recall@{k}")
        numerator.append((i2t < k).astype(np.float64))
        denominator.append(np.ones(images))
    numerator, denominator = np.stack(numerator), np.stack(denominator)
    return Figures(names, numerator, denominator, np.zeros(numerator.shape, dtype=np.int64))


def classification_figures(labels: np.ndarray, correct: dict[str, np.ndarray]) -> Figures:
    """``acc1``/``acc5`` (per image: whether the top k classes hold its label) and ``mean_per_class_recall``
    (top-1 hits grouped by class), from each image's label and its ``correct["acc<k>"]``."""
    names = [*correct, "mean_per_class_recall"]
    numerator = np.stack([*correct.values(), correct["acc1"]]).astype(np.float64)
    groups = np.zeros(numerator.shape, dtype=np.int64)
    groups[-1] = labels
    return Figures(names, numerator, np.ones_like(numerator), groups)


def grouped_ratio(
    numerator: np.ndarray, denominator: np.ndarray, groups: np.ndarray, axis: int = -1
) -> np.ndarray:
    """Per figure and resample: the mean over groups with a unit of sum(numerator) / sum(denominator) within the
    group. Vectorized over every axis but ``axis`` (the units)."""
    numerator, denominator, groups = (np.moveaxis(a, axis, -1) for a in (numerator, denominator, groups))
    lead = numerator.shape[:-1]
    size = int(groups.max(initial=0)) + 1
    rows = int(np.prod(lead, dtype=np.int64))
    key = (groups.reshape(rows, -1) + (np.arange(rows) * size)[:, None]).ravel()
    sums = [
        np.bincount(key, weights=a.reshape(rows, -1).ravel(), minlength=rows * size).reshape(*lead, size)
        for a in (numerator, denominator)
    ]
    present = sums[1] > 0
    ratio = np.divide(sums[0], sums[1], out=np.zeros_like(sums[0]), where=present)
    return ratio.sum(-1) / present.sum(-1)


def _bootstrap(data: tuple[np.ndarray, ...], statistic, bootstrap: Bootstrap):
    from scipy.stats import bootstrap as scipy_bootstrap

    return scipy_bootstrap(
        data,
        statistic,
        n_resamples=bootstrap.resamples,
        confidence_level=bootstrap.confidence,
        method=METHOD,
        paired=True,
        vectorized=True,
        axis=-1,
        batch=max(1, 2_000_000 // data[0].size),  # resamples per call: bounds memory at ~16 MB per array
        rng=np.random.default_rng(bootstrap.seed),
    )


def intervals(figures: Figures, bootstrap: Bootstrap) -> dict[str, list[float]]:
    """Each figure's ``[low, high]`` interval over resampled units."""
    result = _bootstrap((figures.numerator, figures.denominator, figures.groups), grouped_ratio, bootstrap)
    low, high = result.confidence_interval
    return {name: [float(a), float(b)] for name, a, b in zip(figures.names, low, high, strict=True)}


def paired_differences(a: Figures, b: Figures, bootstrap: Bootstrap) -> dict[str, dict[str, object]]:
    """Per figure: ``a``'s value minus ``b``'s, its interval over units drawn the same for both, and the shares
    of resamples where ``a`` scores above and below ``b``. ``a`` and ``b`` hold the same units in the same order."""
    if a.names != b.names or a.numerator.shape != b.numerator.shape:
        raise ValueError(f"the two evaluations hold different figures: {a.names} and {b.names}")

    def difference(na, da, ga, nb, db, gb, axis=-1):
        return grouped_ratio(na, da, ga, axis) - grouped_ratio(nb, db, gb, axis)

    data = (a.numerator, a.denominator, a.groups, b.numerator, b.denominator, b.groups)
    result = _bootstrap(data, difference, bootstrap)
    low, high = result.confidence_interval
    observed = difference(*data)
    drawn = result.bootstrap_distribution
    return {
        name: {
            "difference": float(observed[i]),
            "interval": [float(low[i]), float(high[i])],
            "share_better": float((drawn[i] > 0).mean()),
            "share_worse": float((drawn[i] < 0).mean()),
        }
        for i, name in enumerate(a.names)
    }


def paired_p_values(a: Figures, b: Figures, bootstrap: Bootstrap) -> dict[str, float]:
    """Per figure, the two-sided p-value of a paired permutation test of ``a`` against ``b``: under the null that
    the two score alike, swapping a unit's two outcomes changes nothing (SciPy's ``permutation_test``; exact
    whatever the figure's distribution, which the bootstrap is not for rare hits or misses)."""
    from scipy.stats import permutation_test

    def stacked(f: Figures) -> np.ndarray:  # (3, figures, units): numerator, denominator, group
        return np.stack([f.numerator, f.denominator, f.groups.astype(np.float64)])

    def difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        def figure(z: np.ndarray) -> np.ndarray:
            return grouped_ratio(z[..., 0, :, :], z[..., 1, :, :], z[..., 2, :, :].astype(np.int64), axis)

        return figure(x) - figure(y)

    x, y = stacked(a), stacked(b)
    result = permutation_test(
        (x, y),
        difference,
        permutation_type="samples",
        vectorized=True,
        n_resamples=bootstrap.resamples,
        batch=max(
            1, 2_000_000 // x.size
        ),  # permutations per call: bounds memory as the bootstrap's batches do
        axis=-1,
        rng=np.random.default_rng(bootstrap.seed),
    )
    return {name: float(p) for name, p in zip(a.names, np.atleast_1d(result.pvalue), strict=True)}


HOLM_RULE = (
    "Holm's step-down over the {n} figures compared (paired permutation tests): the chance that any of them is"
    " called a difference when the two checkpoints score alike stays at or below {alpha:g} %"
)


def holm_step_down(p_values: dict[str, float], alpha: float) -> dict[str, tuple[float, bool]]:
    """Per figure, its Holm-adjusted p-value and whether it differs at family-wise error rate ``alpha`` over all
    of ``p_values``; each figure tested at ``alpha`` alone calls one of six figures different far more often than
    ``alpha`` when none is. Equals statsmodels' ``multipletests(method="holm")`` (a test checks it), which runs a
    full garbage collection per call (0.2 s in a process with torch loaded)."""
    names = sorted(p_values, key=p_values.__getitem__)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(names):  # the i-th smallest p-value times the figures left, kept increasing
        running = max(running, min(1.0, (len(names) - rank) * p_values[name]))
        adjusted[name] = running
    return {name: (adjusted[name], adjusted[name] <= alpha) for name in p_values}
