"""Paired significance tests over queries: randomisation (sign-flip permutation) and bootstrap.

Both compare two systems scored on the same queries, through the per-query differences
``d_i = system_i - baseline_i``, and are two-sided on the mean difference:

* Randomisation (paired permutation) test: under the null hypothesis the two systems are
  exchangeable on every query, so each difference is as likely to carry either sign. The p-value is
  the share of sign assignments whose ``|mean(s * d)|`` is at least the observed ``|mean(d)|``.
  With ``n <= EXACT_MAX_N`` queries all ``2**n`` assignments are enumerated (an exact p-value);
  otherwise ``n_resamples`` random assignments are drawn and ``p = (hits + 1) / (n_resamples + 1)``
  (the observed assignment counted once, so a Monte Carlo p-value is never 0).
* Paired bootstrap test (Efron & Tibshirani, ch. 16; Sakai 2006): the differences are shifted to
  mean 0 (the null), resampled with replacement ``n_resamples`` times, and
  ``p = (hits + 1) / (n_resamples + 1)`` where a hit is a resample with ``|mean| >= |mean(d)|``.
  The same resamples, unshifted, give a percentile confidence interval of the mean difference.

Everything is seeded: the same inputs and seed give the same p-values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from r2med_agent.errors import ConfigError, DataError

TestName = Literal["permutation", "bootstrap"]
TESTS: tuple[str, ...] = ("permutation", "bootstrap")

EXACT_MAX_N = 16
"""Up to this many queries the permutation test enumerates all ``2**n`` sign assignments."""

TIE_TOLERANCE = 1e-9
"""Two per-query scores closer than this are a tie in win/tie/loss counts."""

_SUM_TOLERANCE = 1e-12
"""Slack when comparing a resampled statistic with the observed one, so that floating-point noise
in sums of the same numbers in another order does not turn an equal statistic into a smaller one."""

_CHUNK = 2048

OVERALL = "all"
"""Key of the pooled test (all queries of the common tasks) in :func:`compare_tasks`' result."""


@dataclass(frozen=True)
class PairedTest:
    """One paired comparison of a system against a baseline.

    Attributes:
        n: number of queries compared.
        baseline_mean: mean score of the baseline over those queries.
        system_mean: mean score of the system over those queries.
        p_value: two-sided p-value of the test named in ``test``.
        test: ``permutation`` or ``bootstrap``.
        exact: True when the permutation distribution was enumerated, not sampled.
        wins: queries where the system beats the baseline by more than TIE_TOLERANCE.
        ties: queries within TIE_TOLERANCE.
        losses: queries where the baseline is better.
        ci_low: lower end of the 95% bootstrap interval of the mean difference (bootstrap only).
        ci_high: upper end of that interval (bootstrap only).
    """

    n: int
    baseline_mean: float
    system_mean: float
    p_value: float
    test: str
    exact: bool
    wins: int
    ties: int
    losses: int
    ci_low: float | None = None
    ci_high: float | None = None

    @property
    def mean_diff(self) -> float:
        """``system_mean - baseline_mean``."""
        return self.system_mean - self.baseline_mean

    def significant(self, alpha: float = 0.05) -> bool:
        return self.p_value < alpha


def _diffs(baseline: Sequence[float], system: Sequence[float]) -> np.ndarray:
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(system, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples must be two equal-length lists, got {a.shape} and {b.shape}")
    if a.size == 0:
        raise ValueError("paired test needs at least one query")
    return b - a


def permutation_test(
    baseline: Sequence[float],
    system: Sequence[float],
    *,
    n_resamples: int = 10_000,
    seed: int = 0,
    exact: bool | None = None,
) -> tuple[float, bool]:
    """Two-sided paired randomisation (sign-flip) test of the mean difference.

    Args:
        baseline: per-query scores of the baseline.
        system: per-query scores of the other system, same query order.
        n_resamples: random sign assignments drawn when not exact.
        seed: seed of the random generator (Monte Carlo path only).
        exact: enumerate all ``2**n`` assignments; ``None`` decides by ``n <= EXACT_MAX_N``.

    Returns:
        ``(p_value, exact)``.
    """
    d = _diffs(baseline, system)
    n = d.size
    observed = abs(float(d.sum()))
    if exact is None:
        exact = n <= EXACT_MAX_N
    if exact:
        if n > 24:
            raise ValueError(f"exact enumeration of 2**{n} sign assignments is too large; use exact=False")
        hits = 0
        total = 1 << n
        bits = np.arange(n, dtype=np.int64)
        for start in range(0, total, 1 << 16):
            codes = np.arange(start, min(total, start + (1 << 16)), dtype=np.int64)
            signs = 1.0 - 2.0 * ((codes[:, None] >> bits) & 1)
            hits += int(np.count_nonzero(np.abs(signs @ d) + _SUM_TOLERANCE >= observed))
        return hits / total, True
    if n_resamples < 1:
        raise ValueError("n_resamples must be at least 1")
    rng = np.random.default_rng(seed)
    hits = 0
    done = 0
    while done < n_resamples:
        m = min(_CHUNK, n_resamples - done)
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(m, n))
        hits += int(np.count_nonzero(np.abs(signs @ d) + _SUM_TOLERANCE >= observed))
        done += m
    return (hits + 1) / (n_resamples + 1), False


def bootstrap_test(
    baseline: Sequence[float],
    system: Sequence[float],
    *,
    n_resamples: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """Two-sided paired bootstrap test of the mean difference (null: shifted to mean 0).

    Returns:
        ``(p_value, ci_low, ci_high)``: the p-value and the percentile interval of
        ``mean(system - baseline)`` at ``confidence``.
    """
    d = _diffs(baseline, system)
    if n_resamples < 1:
        raise ValueError("n_resamples must be at least 1")
    n = d.size
    mean = float(d.mean())
    shifted = d - mean
    observed = abs(mean) * n
    rng = np.random.default_rng(seed)
    hits = 0
    means: list[np.ndarray] = []
    done = 0
    while done < n_resamples:
        m = min(_CHUNK, n_resamples - done)
        idx = rng.integers(0, n, size=(m, n))
        sums = shifted[idx].sum(axis=1)
        hits += int(np.count_nonzero(np.abs(sums) + _SUM_TOLERANCE >= observed))
        means.append(sums / n + mean)
        done += m
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(np.concatenate(means), [tail, 1.0 - tail])
    return (hits + 1) / (n_resamples + 1), float(lo), float(hi)


def win_tie_loss(
    baseline: Sequence[float], system: Sequence[float], tol: float = TIE_TOLERANCE
) -> tuple[int, int, int]:
    """Queries where ``system`` is better, within ``tol`` of, or worse than ``baseline``."""
    d = _diffs(baseline, system)
    wins = int(np.count_nonzero(d > tol))
    losses = int(np.count_nonzero(d < -tol))
    return wins, d.size - wins - losses, losses


def paired_test(
    baseline: Sequence[float],
    system: Sequence[float],
    *,
    test: str = "permutation",
    n_resamples: int = 10_000,
    seed: int = 0,
) -> PairedTest:
    """Run ``test`` (``permutation`` or ``bootstrap``) on paired per-query scores."""
    if test not in TESTS:
        raise ConfigError(f"unknown significance test '{test}'; allowed: {', '.join(TESTS)}")
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(system, dtype=np.float64)
    wins, ties, losses = win_tie_loss(a, b)
    ci_low = ci_high = None
    if test == "permutation":
        p, exact = permutation_test(a, b, n_resamples=n_resamples, seed=seed)
    else:
        p, ci_low, ci_high = bootstrap_test(a, b, n_resamples=n_resamples, seed=seed)
        exact = False
    return PairedTest(
        n=int(a.size),
        baseline_mean=float(a.mean()),
        system_mean=float(b.mean()),
        p_value=float(p),
        test=test,
        exact=exact,
        wins=wins,
        ties=ties,
        losses=losses,
        ci_low=ci_low,
        ci_high=ci_high,
    )


def compare_tasks(
    baseline: Mapping[str, Mapping[str, float]],
    system: Mapping[str, Mapping[str, float]],
    *,
    test: str = "permutation",
    n_resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, PairedTest]:
    """Paired tests per task and over the pooled queries of the tasks both systems have.

    Args:
        baseline: ``{task: {query_id: score}}`` of the baseline.
        system: the same shape for the other system.

    Returns:
        ``{task: PairedTest}`` for every common task, plus ``OVERALL`` (``"all"``) pooling every
        query of those tasks. Tasks are paired query by query; a query present on one side only is
        an error (both sides must score the same queries).
    """
    out: dict[str, PairedTest] = {}
    pooled_a: list[float] = []
    pooled_b: list[float] = []
    for task in [t for t in baseline if t in system]:
        qa, qb = baseline[task], system[task]
        if set(qa) != set(qb):
            only_a = sorted(set(qa) - set(qb))
            only_b = sorted(set(qb) - set(qa))
            raise DataError(
                f"task {task}: the two runs score different queries (only in baseline: "
                f"{', '.join(only_a[:5]) or '-'}; only in the other: {', '.join(only_b[:5]) or '-'}); "
                "paired tests need the same queries on both sides"
            )
        if not qa:
            continue
        qids = sorted(qa)
        a = [float(qa[q]) for q in qids]
        b = [float(qb[q]) for q in qids]
        out[task] = paired_test(a, b, test=test, n_resamples=n_resamples, seed=seed)
        pooled_a += a
        pooled_b += b
    if pooled_a:
        out[OVERALL] = paired_test(pooled_a, pooled_b, test=test, n_resamples=n_resamples, seed=seed)
    return out
