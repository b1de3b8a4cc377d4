"""Bootstrap intervals and paired comparisons: coverage by simulation, each with a control that must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mm_lightning.evaluation.intervals import (
    Bootstrap,
    Figures,
    classification_figures,
    grouped_ratio,
    holm_step_down,
    intervals,
    paired_differences,
    paired_p_values,
    retrieval_figures,
)
from mm_lightning.evaluation.metrics import retrieval_metrics
from mm_lightning.evaluation.zeroshot import ImageOutcomes, classification_metrics

TRIALS = 300
# the share of TRIALS intervals that must cover the true value: 0.95 within ~3 binomial standard errors
COVERED = (0.91, 0.985)


def one_figure(numerator: np.ndarray, denominator: np.ndarray) -> Figures:
    return Figures(
        ["figure"], numerator[None], denominator[None], np.zeros((1, len(numerator)), dtype=np.int64)
    )


def coverage(trial, shrink: float = 1.0, seed: int = 0) -> float:
    """The share of trials whose interval (shrunk about its midpoint by ``shrink``) covers the true value;
    ``trial(rng)`` gives (figures, true value)."""
    rng = np.random.default_rng(seed)
    covered = 0
    for number in range(TRIALS):
        figures, truth = trial(rng)
        low, high = intervals(figures, Bootstrap(resamples=500, seed=number))["figure"]
        middle, half = (low + high) / 2, shrink * (high - low) / 2
        covered += middle - half <= truth <= middle + half
    return covered / TRIALS


def bernoulli_trial(rng: np.random.Generator, p: float = 0.3, n: int = 200) -> tuple[Figures, float]:
    return one_figure(rng.binomial(1, p, n).astype(float), np.ones(n)), p


def test_interval_covers_a_known_proportion_at_its_rate() -> None:
    assert COVERED[0] <= coverage(bernoulli_trial) <= COVERED[1]


def test_control_a_too_narrow_interval_fails_the_coverage_check() -> None:
    assert not COVERED[0] <= coverage(bernoulli_trial, shrink=0.6) <= COVERED[1]


CAPTIONS = 5


def clustered_trial(rng: np.random.Generator, images: int = 80) -> tuple[np.ndarray, float]:
    """Per caption, a hit: each image's captions all hit or all miss (their image is easy or hard), as captions of
    one image tend to; the true recall is 0.4."""
    per_image = rng.binomial(1, 0.4, images)
    return np.repeat(per_image, CAPTIONS), 0.4


def test_resampling_images_with_their_captions_covers_correlated_captions() -> None:
    def by_image(rng):
        hits, truth = clustered_trial(rng)
        column = np.repeat(np.arange(len(hits) // CAPTIONS), CAPTIONS)
        ranks = np.where(hits == 1, 0, 5)
        figures = retrieval_figures(ranks, np.zeros(len(hits) // CAPTIONS, dtype=np.int64), column, ks=(1,))
        keep = [figures.names.index("image_retrieval_recall@1")]
        return Figures(
            ["figure"], figures.numerator[keep], figures.denominator[keep], figures.groups[keep]
        ), truth

    assert COVERED[0] <= coverage(by_image) <= COVERED[1]


def test_control_resampling_captions_alone_is_too_narrow_for_correlated_captions() -> None:
    def by_caption(rng):
        hits, truth = clustered_trial(rng)
        return one_figure(hits.astype(float), np.ones(len(hits))), truth

    assert coverage(by_caption) < COVERED[0]


def test_retrieval_figures_equal_the_metrics_on_the_whole_test_set() -> None:
    torch.manual_seed(0)
    image_ids = torch.arange(12).repeat_interleave(torch.tensor([1, 2, 3] * 4))  # 1 to 3 captions per image
    images, texts = torch.randn(len(image_ids), 8), torch.randn(len(image_ids), 8)
    texts[::2] += 2 * images[::2]  # some captions close to their image
    from mm_lightning.evaluation.metrics import dedup_images, retrieval_ranks

    _, unique, column = dedup_images(torch.nn.functional.normalize(images, dim=-1), image_ids)
    text = torch.nn.functional.normalize(texts, dim=-1)
    ranks = retrieval_ranks(lambda s, e: text[s:e] @ unique.T, len(text), len(unique), column, 1024)
    figures = retrieval_figures(ranks.t2i.numpy(), ranks.i2t.numpy(), ranks.column.numpy())
    expected = retrieval_metrics(images, texts, image_ids)
    for k in (1, 5, 10):
        assert figures.values()[f"image_retrieval_recall@{k}"] == pytest.approx(float(expected[f"r{k}_t2i"]))
        assert figures.values()[f"text_retrieval_recall@{k}"] == pytest.approx(float(expected[f"r{k}_i2t"]))
    assert 0 < figures.values()["image_retrieval_recall@1"] < 1  # not a degenerate case


def test_classification_figures_equal_torchmetrics() -> None:
    torch.manual_seed(0)
    classes, images = 7, 60
    labels = torch.randint(0, classes - 1, (images,))  # the last class has no image
    logits = torch.randn(images, classes) + 1.5 * torch.nn.functional.one_hot(labels, classes)
    metrics = classification_metrics(classes)
    outcomes = ImageOutcomes([1, 5])
    for rows in (torch.arange(25, images), torch.arange(25)):  # the later images first
        for metric in metrics.values():
            metric.update(logits[rows], labels[rows])
        outcomes.update(logits[rows], labels[rows], rows)
    per_image = outcomes.compute()
    assert torch.equal(per_image["index"], torch.arange(images))
    figures = classification_figures(
        per_image["label"].numpy(), {k: per_image[k].numpy() for k in ("acc1", "acc5")}
    )
    for name, metric in metrics.items():
        assert figures.values()[name] == pytest.approx(float(metric.compute()), abs=1e-6), name
    assert figures.values()["mean_per_class_recall"] != pytest.approx(
        figures.values()["acc1"]
    )  # it is grouped


def test_grouped_ratio_per_resample_equals_a_loop() -> None:
    rng = np.random.default_rng(1)
    numerator = rng.integers(0, 3, (2, 4, 30)).astype(float)
    denominator = np.full(numerator.shape, 2.0)
    groups = rng.integers(0, 5, numerator.shape)
    got = grouped_ratio(numerator, denominator, groups)
    for i in range(2):
        for j in range(4):
            ratios = [
                numerator[i, j][groups[i, j] == g].sum() / denominator[i, j][groups[i, j] == g].sum()
                for g in np.unique(groups[i, j])
            ]
            assert got[i, j] == pytest.approx(np.mean(ratios))


def test_a_checkpoint_against_itself_differs_by_exactly_zero() -> None:
    rng = np.random.default_rng(2)
    figures = one_figure(rng.binomial(1, 0.5, 100).astype(float), np.ones(100))
    same = paired_differences(figures, figures, Bootstrap(resamples=200))["figure"]
    assert same == {"difference": 0.0, "interval": [0.0, 0.0], "share_better": 0.0, "share_worse": 0.0}


def test_paired_comparison_sees_a_small_gain_that_separate_intervals_cannot() -> None:
    rng = np.random.default_rng(3)
    baseline = rng.binomial(1, 0.5, 300).astype(float)
    better = baseline.copy()
    better[np.flatnonzero(baseline == 0)[:15]] = 1  # 15 more hits out of 300: +5 points, no new misses
    a, b = one_figure(better, np.ones(300)), one_figure(baseline, np.ones(300))
    drawn = Bootstrap(resamples=1000)
    paired = paired_differences(a, b, drawn)["figure"]
    assert paired["difference"] == pytest.approx(0.05)
    assert paired["interval"][0] > 0 and paired["share_better"] > 0.99
    # the control: each checkpoint's own interval overlaps the other's, so on their own they would not tell
    better_low, baseline_high = intervals(a, drawn)["figure"][0], intervals(b, drawn)["figure"][1]
    assert better_low < baseline_high


def test_the_seed_decides_the_resamples() -> None:
    figures = one_figure(np.random.default_rng(4).binomial(1, 0.5, 100).astype(float), np.ones(100))
    first, again = (intervals(figures, Bootstrap(resamples=200, seed=7)) for _ in range(2))
    assert first == again
    assert intervals(figures, Bootstrap(resamples=200, seed=8)) != first


@pytest.mark.parametrize("options", [{"resamples": 0}, {"confidence": 1.0}, {"confidence": 0.0}])
def test_bootstrap_options_out_of_range_are_refused(options: dict) -> None:
    with pytest.raises(ValueError, match="bootstrap"):
        Bootstrap(**options)


def null_retrieval_pair(rng: np.random.Generator, images: int = 60) -> tuple[Figures, Figures]:
    """Two checkpoints that score alike: each image's difficulty is shared, each one's ranks drawn apart."""
    difficulty = rng.uniform(0.5, 30, images)
    column = np.repeat(np.arange(images), CAPTIONS)

    def ranks() -> Figures:
        t2i = np.floor(rng.exponential(difficulty[column])).astype(int)
        return retrieval_figures(t2i, np.floor(rng.exponential(difficulty / 2)).astype(int), column)

    return ranks(), ranks()


def test_holm_keeps_the_family_wise_error_of_six_figures_under_the_null() -> None:
    rng, alpha, trials = np.random.default_rng(5), 0.05, 200
    holm = per_figure = 0
    for number in range(trials):
        p_values = paired_p_values(*null_retrieval_pair(rng), Bootstrap(resamples=400, seed=number))
        assert len(p_values) == 6
        holm += any(outside for _, outside in holm_step_down(p_values, alpha).values())
        per_figure += any(p <= alpha for p in p_values.values())
    assert holm / trials <= alpha
    # the control: each figure tested at 5 % alone calls some difference in far more than 5 % of null trials
    assert per_figure / trials > 2 * alpha


def test_holm_calls_a_real_gain_outside_the_noise() -> None:
    rng = np.random.default_rng(6)
    a, b = null_retrieval_pair(rng, images=200)
    better = Figures(a.names, b.numerator.copy(), b.denominator, b.groups)
    better.numerator[:3] = np.maximum(b.numerator[:3], b.denominator[:3] * (rng.random(200) < 0.3))
    verdict = holm_step_down(paired_p_values(better, b, Bootstrap(resamples=1000)), 0.05)
    assert all(verdict[f"image_retrieval_recall@{k}"][1] for k in (1, 5, 10))
    assert not any(verdict[f"text_retrieval_recall@{k}"][1] for k in (1, 5, 10))  # the same outcomes


def test_holm_step_down_equals_statsmodels() -> None:
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(7)
    cases = [rng.uniform(0, 0.1, 6), rng.uniform(0, 1, 6), [0.01, 0.01, 0.04, 1.0, 0.0, 0.02], [0.2] * 3]
    for p_values in cases:
        named = {f"figure{i}": float(p) for i, p in enumerate(p_values)}
        ours = holm_step_down(named, 0.05)
        rejected, adjusted, _, _ = multipletests(list(named.values()), 0.05, method="holm")
        assert [ours[name][0] for name in named] == pytest.approx(adjusted.tolist())
        assert [ours[name][1] for name in named] == rejected.tolist()
