"""Paired significance tests: exact enumeration against hand arithmetic, Monte Carlo against exact,
bootstrap against its enumerable distribution, scipy as a peer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.stats import (
    OVERALL,
    bootstrap_test,
    compare_tasks,
    paired_test,
    permutation_test,
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


def test_compare_tasks_pools_the_common_tasks():
    base = {"A": {"q1": 0.1, "q2": 0.2}, "B": {"x": 0.5, "y": 0.5, "z": 0.0}, "C": {"c": 1.0}}
    sys_ = {"A": {"q1": 0.3, "q2": 0.2}, "B": {"x": 0.6, "y": 0.4, "z": 0.5}}
    out = compare_tasks(base, sys_)
    assert set(out) == {"A", "B", OVERALL}
    assert out[OVERALL].n == 5
    assert (out[OVERALL].wins, out[OVERALL].ties, out[OVERALL].losses) == (3, 1, 1)
    # Pooled d = (0.2, 0, 0.1, -0.1, 0.5) over 5 queries: enumerate the 32 assignments by hand.
    d = [0.2, 0.0, 0.1, -0.1, 0.5]
    obs = abs(sum(d))
    hits = sum(
        1 for s in itertools.product((1, -1), repeat=5) if abs(sum(x * y for x, y in zip(s, d))) + 1e-12 >= obs
    )
    assert out[OVERALL].p_value == hits / 32
    assert out[OVERALL].exact


def test_compare_tasks_rejects_different_query_sets():
    with pytest.raises(DataError, match="different queries"):
        compare_tasks({"A": {"q1": 0.1, "q2": 0.2}}, {"A": {"q1": 0.3}})


def test_unknown_test_name():
    with pytest.raises(ConfigError, match="permutation, bootstrap"):
        paired_test([0.1], [0.2], test="t-test")
