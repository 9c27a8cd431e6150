"""Paired significance tests: exact enumeration against hand arithmetic, Monte Carlo against exact,
bootstrap against its enumerable distribution, scipy as a peer; the stratified test over tasks
against a hand enumeration with unequal task sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.analysis.stats import (
    OVERALL,
    bootstrap_test,
    compare_tasks,
    paired_test,
    permutation_test,
    stratified_test,
    win_tie_loss,
)


def test_exact_permutation_matches_hand_enumeration():
    # d = system - baseline = (0.5, 0.25, 0.125, -0.0625); observed sum 0.8125.
    # The 16 sign assignments give sums +-0.5 +-0.25 +-0.125 +-0.0625; |sum| >= 0.8125 only for
    # +0.5+0.25+0.125+-0.0625 (0.9375, 0.8125) and their mirror images: 4 of 16 -> p = 0.25.
    baseline = [0.0, 0.25, 0.5, 0.5]
    system = [0.5, 0.5, 0.625, 0.4375]
    p, exact = permutation_test(baseline, system)
    assert exact is True
    assert p == 0.25


def test_exact_permutation_with_decimal_ties_is_not_broken_by_rounding():
    # d = (0.3, -0.1, 0.2): the 8 signed sums are +-0.6, +-0.4, +-0.2, 0, 0; |sum| >= 0.4 for 4 of 8.
    # 0.3 - 0.1 + 0.2 in floating point differs from 0.4 in the last bit; the tolerance keeps it.
    p, exact = permutation_test([0.1, 0.5, 0.3], [0.4, 0.4, 0.5])
    assert exact and p == 0.5


def test_identical_systems_have_p_one_and_all_ties():
    a = [0.1, 0.7, 0.3, 0.0]
    t = paired_test(a, list(a))
    assert t.p_value == 1.0
    assert (t.wins, t.ties, t.losses) == (0, 4, 0)
    assert t.mean_diff == 0.0


def test_single_query_exact_p_is_one():
    # Two assignments (+d, -d), both with |sum| = |d|.
    assert permutation_test([0.2], [0.9]) == (1.0, True)


def test_monte_carlo_agrees_with_exact_enumeration():
    rng = np.random.default_rng(7)
    a = rng.random(18)
    b = np.clip(a + rng.normal(0.08, 0.2, 18), 0, 1)
    exact_p, exact = permutation_test(a, b, exact=True)
    mc_p, mc_exact = permutation_test(a, b, n_resamples=10_000, seed=1)
    assert exact and not mc_exact
    # Monte Carlo standard error at 10k draws is below 0.005; allow 4 of them.
    assert abs(mc_p - exact_p) < 0.02
    # Seeded: the same seed gives the same p-value.
    assert permutation_test(a, b, n_resamples=10_000, seed=1)[0] == mc_p


def test_auto_switches_to_monte_carlo_above_sixteen_queries():
    a = [0.0] * 17
    b = [1.0] * 17
    p, exact = permutation_test(a, b, n_resamples=1000, seed=0)
    assert not exact
    # Only the all-plus and all-minus assignments reach |sum| = 17: expected hits ~ 1000 / 2**16,
    # so the p-value is the add-one floor (hits + 1) / (n + 1).
    assert p == pytest.approx(1 / 1001)


def test_exact_matches_scipy_permutation_test():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    a = rng.random(10)
    b = rng.random(10)
    ours, exact = permutation_test(a, b)
    ref = stats.permutation_test(
        (b, a),
        lambda x, y: np.mean(x - y),
        permutation_type="samples",
        alternative="two-sided",
        n_resamples=np.inf,
    )
    assert exact
    assert ours == pytest.approx(ref.pvalue, abs=1e-12)


def test_bootstrap_on_an_enumerable_distribution():
    # d = (1, 0): shifted to mean 0 it is (0.5, -0.5). A bootstrap resample of two draws has mean
    # 0.5 (p 1/4), -0.5 (1/4) or 0 (1/2); |mean| >= |mean(d)| = 0.5 with probability exactly 1/2.
    p, lo, hi = bootstrap_test([0.0, 0.0], [1.0, 0.0], n_resamples=10_000, seed=0)
    assert abs(p - 0.5) < 0.025  # 5 standard errors
    # Unshifted resample means are 0, 0.5 or 1: the 95% interval spans them.
    assert (lo, hi) == (0.0, 1.0)


def test_bootstrap_is_seeded_and_detects_a_clear_difference():
    rng = np.random.default_rng(11)
    a = rng.random(60) * 0.5
    b = a + 0.2 + rng.normal(0, 0.05, 60)
    first = bootstrap_test(a, b, n_resamples=5000, seed=4)
    assert bootstrap_test(a, b, n_resamples=5000, seed=4) == first
    p, lo, hi = first
    assert p == pytest.approx(1 / 5001)
    assert lo < float(np.mean(b - a)) < hi
    assert lo > 0.15


def test_win_tie_loss_counts_ties_within_tolerance():
    a = [0.5, 0.5, 0.2, 0.1, 0.3]
    b = [0.5 + 1e-12, 0.6, 0.1, 0.1, 0.3 - 5e-10]
    assert win_tie_loss(a, b) == (1, 3, 1)


def test_stratified_permutation_matches_hand_enumeration_with_unequal_task_sizes():
    # Task A, 2 queries: d = system - baseline = (0.6, 0.6); task B, 3 queries: d = (-0.3, -0.3, -0.3).
    # Statistic: mean over the 2 tasks of the per-task mean differences = (0.6 + -0.3) / 2 = 0.15,
    # i.e. sum of d_i / (K * n_k): each A query adds +-0.6/4 = +-0.15, each B query +-0.3/6 = +-0.05.
    # The 32 sign assignments: A's part is +0.3 (1 way), 0 (2 ways) or -0.3 (1 way); B's part is
    # +-0.15 (1 way each) or +-0.05 (3 ways each). |T| >= 0.15:
    #   A = +0.3: T in {0.45, 0.35, 0.25, 0.15}, all 8 B assignments hit        -> 8
    #   A =  0  : |T| = |B| >= 0.15 only for B = +-0.15: 2 of 8, times 2 ways  -> 4
    #   A = -0.3: T in {-0.15, -0.25, -0.35, -0.45}, all 8 hit                  -> 8
    # 20 of 32 -> p = 0.625. (Pooling the 5 queries instead gives sum d = 0.3 and p = 1: every
    # assignment has |sum| >= 0.3, a different test.)
    base = {"A": {"a1": 0.2, "a2": 0.3}, "B": {"b1": 0.5, "b2": 0.6, "b3": 0.4}}
    sys_ = {"A": {"a1": 0.8, "a2": 0.9}, "B": {"b1": 0.2, "b2": 0.3, "b3": 0.1}}
    out = compare_tasks(base, sys_)
    t = out[OVERALL]
    assert t.exact and t.strata == 2 and t.n == 5
    assert t.p_value == 20 / 32
    assert t.mean_diff == pytest.approx(0.15)
    assert t.baseline_mean == pytest.approx((0.25 + 0.5) / 2)
    assert t.system_mean == pytest.approx((0.85 + 0.2) / 2)
    assert (t.wins, t.ties, t.losses) == (2, 0, 3)
    pooled = paired_test([0.2, 0.3, 0.5, 0.6, 0.4], [0.8, 0.9, 0.2, 0.3, 0.1])
    assert pooled.p_value == 1.0
    # Per-task tests are the plain paired tests of each task.
    assert out["A"] == paired_test([0.2, 0.3], [0.8, 0.9])
    # A brute-force enumeration agrees.
    d = [(0.6, 4), (0.6, 4), (-0.3, 6), (-0.3, 6), (-0.3, 6)]
    obs = abs(sum(x / w for x, w in d))
    hits = sum(
        1 for s in itertools.product((1, -1), repeat=5)
        if abs(sum(si * x / w for si, (x, w) in zip(s, d))) + 1e-12 >= obs
    )
    assert hits == 20


def test_stratified_test_follows_the_average_not_the_pooled_queries():
    # The reviewer's case: Biology, 6 queries, 0.1 -> 0.9; MedQA-Diag, 200 queries, 0.5 -> 0.45.
    # Averages over the two tasks: 0.3 -> 0.675, clearly better; pooled over the 206 queries the
    # mean difference is (6 * 0.8 - 200 * 0.05) / 206 < 0 and a pooled test calls it worse.
    base = {"Biology": {f"b{i}": 0.1 for i in range(6)}, "MedQA-Diag": {f"m{i}": 0.5 for i in range(200)}}
    sys_ = {"Biology": {f"b{i}": 0.9 for i in range(6)}, "MedQA-Diag": {f"m{i}": 0.45 for i in range(200)}}
    pooled = paired_test([0.1] * 6 + [0.5] * 200, [0.9] * 6 + [0.45] * 200, seed=0)
    assert pooled.mean_diff < 0 and pooled.p_value < 0.05
    t = compare_tasks(base, sys_, seed=0)[OVERALL]
    assert t.mean_diff == pytest.approx(0.375) and t.baseline_mean == pytest.approx(0.3)
    # |T| >= 0.375 needs all six Biology signs alike (+-0.4; MedQA's part is at most 0.025 and
    # cannot undo it): probability 2/64 = 0.03125. 10,000 draws: standard error 0.0017.
    assert not t.exact and abs(t.p_value - 2 / 64) < 0.01
    boot = compare_tasks(base, sys_, test="bootstrap", seed=0)[OVERALL]
    # Every Biology resample has mean 0.8 and every MedQA one -0.05: T* = 0.375 always, so the
    # interval is the point and no shifted resample is as far from 0 as observed.
    assert boot.ci_low == pytest.approx(0.375) and boot.ci_high == pytest.approx(0.375)
    assert boot.p_value == pytest.approx(1 / 10_001)


def test_stratified_bootstrap_on_an_enumerable_distribution():
    # Task A: d = (1, 0), task B: d = (0,). T = (0.5 + 0) / 2 = 0.25. A's resampled mean is 0, 0.5
    # or 1 with probability 1/4, 1/2, 1/4 and B's is always 0, so T* is 0, 0.25 or 0.5.
    # |T* - T| >= |T| = 0.25 for T* in {0, 0.5}: probability exactly 1/2.
    t = stratified_test([[0.0, 0.0], [0.3]], [[1.0, 0.0], [0.3]], test="bootstrap", n_resamples=10_000, seed=0)
    assert abs(t.p_value - 0.5) < 0.025  # 5 standard errors
    assert (t.ci_low, t.ci_high) == (0.0, 0.5)
    assert t.mean_diff == pytest.approx(0.25) and t.strata == 2


def test_stratified_over_one_task_is_the_plain_paired_test():
    rng = np.random.default_rng(5)
    a, b = rng.random(12), rng.random(12)
    one = stratified_test([a], [b])
    plain = paired_test(a, b)
    assert (one.p_value, one.exact, one.n) == (plain.p_value, plain.exact, plain.n)
    assert one.mean_diff == pytest.approx(plain.mean_diff)
    a, b = rng.random(40), rng.random(40)
    boot = stratified_test([a], [b], test="bootstrap", seed=3, n_resamples=3000)
    p, lo, hi = bootstrap_test(a, b, seed=3, n_resamples=3000)
    assert boot.p_value == p and boot.ci_low == pytest.approx(lo) and boot.ci_high == pytest.approx(hi)


def test_compare_tasks_rejects_different_query_sets():
    with pytest.raises(DataError, match="different queries"):
        compare_tasks({"A": {"q1": 0.1, "q2": 0.2}}, {"A": {"q1": 0.3}})


def test_unknown_test_name():
    with pytest.raises(ConfigError, match="permutation, bootstrap"):
        paired_test([0.1], [0.2], test="t-test")
