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

Over several tasks (:func:`stratified_test`, the table's Avg column) the statistic is what that
column shows: the mean over tasks of the per-task mean differences,
``T = (1/K) * sum_k mean(d_k)``, so every task weighs the same whatever its number of queries
(pooling the queries instead would let a 200-query task outvote a 6-query one, and could mark a
row with the better average as significantly worse). The randomisation test flips the sign of each
query's difference (queries stay in their task, so ``T`` becomes ``sum_k sum_i s_i d_ki / (K n_k)``);
the bootstrap resamples queries within each task and averages the per-task means.

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
"""Key of the stratified test over the common tasks in :func:`compare_tasks`' result."""


@dataclass(frozen=True)
class PairedTest:
    """One paired comparison of a system against a baseline.

    Attributes:
        n: number of queries compared (over all tasks of a stratified test).
        baseline_mean: mean score of the baseline over those queries (stratified: the mean over
            tasks of the per-task means).
        system_mean: the same for the system.
        p_value: two-sided p-value of the test named in ``test``.
        test: ``permutation`` or ``bootstrap``.
        exact: True when the permutation distribution was enumerated, not sampled.
        wins: queries where the system beats the baseline by more than TIE_TOLERANCE.
        ties: queries within TIE_TOLERANCE.
        losses: queries where the baseline is better.
        ci_low: lower end of the 95% bootstrap interval of the mean difference (bootstrap only).
        ci_high: upper end of that interval (bootstrap only).
        strata: number of tasks the test is stratified over (1: a single task).
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
    strata: int = 1

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


def _sign_flip_p(
    contrib: np.ndarray, *, n_resamples: int, seed: int, exact: bool | None
) -> tuple[float, bool]:
    """Two-sided sign-flip p-value of ``|sum(contrib)|`` (each element's sign flipped at random)."""
    n = contrib.size
    observed = abs(float(contrib.sum()))
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
            hits += int(np.count_nonzero(np.abs(signs @ contrib) + _SUM_TOLERANCE >= observed))
        return hits / total, True
    if n_resamples < 1:
        raise ValueError("n_resamples must be at least 1")
    rng = np.random.default_rng(seed)
    hits = 0
    done = 0
    while done < n_resamples:
        m = min(_CHUNK, n_resamples - done)
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(m, n))
        hits += int(np.count_nonzero(np.abs(signs @ contrib) + _SUM_TOLERANCE >= observed))
        done += m
    return (hits + 1) / (n_resamples + 1), False


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
    return _sign_flip_p(_diffs(baseline, system), n_resamples=n_resamples, seed=seed, exact=exact)


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
    return _bootstrap([_diffs(baseline, system)], n_resamples, seed, confidence)


def _bootstrap(
    ds: Sequence[np.ndarray], n_resamples: int, seed: int, confidence: float
) -> tuple[float, float, float]:
    """Bootstrap of ``T = mean over strata of the mean difference``: queries resampled with
    replacement within each stratum; the p-value counts resamples at least as far from ``T`` as
    ``T`` is from 0 (the resampling distribution shifted to the null), and the unshifted resamples
    give the percentile interval. Returns ``(p_value, ci_low, ci_high)``."""
    if n_resamples < 1:
        raise ValueError("n_resamples must be at least 1")
    observed = float(np.mean([d.mean() for d in ds]))
    rng = np.random.default_rng(seed)
    hits = 0
    stats: list[np.ndarray] = []
    done = 0
    while done < n_resamples:
        m = min(_CHUNK, n_resamples - done)
        total = np.zeros(m)
        for d in ds:
            total += d[rng.integers(0, d.size, size=(m, d.size))].mean(axis=1)
        resampled = total / len(ds)
        hits += int(np.count_nonzero(np.abs(resampled - observed) + _SUM_TOLERANCE >= abs(observed)))
        stats.append(resampled)
        done += m
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(np.concatenate(stats), [tail, 1.0 - tail])
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


def stratified_test(
    baseline: Sequence[Sequence[float]],
    system: Sequence[Sequence[float]],
    *,
    test: str = "permutation",
    n_resamples: int = 10_000,
    seed: int = 0,
    exact: bool | None = None,
    confidence: float = 0.95,
) -> PairedTest:
    """Paired test of the mean over tasks of the per-task mean differences.

    The statistic is ``T = (1/K) * sum_k mean(system_k - baseline_k)``, the difference of the two
    systems' task-averaged scores (the table's Avg column), so each task weighs the same whatever
    its number of queries. ``permutation`` flips the sign of each query's difference (exact over
    all ``2**n`` assignments when the total ``n <= EXACT_MAX_N``, else ``n_resamples`` random
    ones); ``bootstrap`` resamples queries with replacement within each task, and its unshifted
    resamples give the percentile interval of ``T``.

    Args:
        baseline: per task, the baseline's per-query scores.
        system: per task, the system's scores of the same queries in the same order.
        test: ``permutation`` or ``bootstrap``.
        n_resamples: random sign assignments / bootstrap resamples.
        seed: seed of the random generator.
        exact: force (True) or forbid (False) exact enumeration; None decides by size.
        confidence: level of the bootstrap interval.

    Returns:
        A PairedTest whose means are task averages, ``n`` the total number of queries, win/tie/loss
        counted over all queries and ``strata`` the number of tasks.
    """
    if test not in TESTS:
        raise ConfigError(f"unknown significance test '{test}'; allowed: {', '.join(TESTS)}")
    if len(baseline) != len(system) or not baseline:
        raise ValueError("stratified test needs the same, non-empty list of tasks on both sides")
    ds = [_diffs(a, b) for a, b in zip(baseline, system)]
    k = len(ds)
    wins = ties = losses = 0
    for a, b in zip(baseline, system):
        w, t, l_ = win_tie_loss(a, b)
        wins, ties, losses = wins + w, ties + t, losses + l_
    ci_low = ci_high = None
    if test == "permutation":
        weights = np.concatenate([np.full(d.size, 1.0 / (k * d.size)) for d in ds])
        p, exact = _sign_flip_p(np.concatenate(ds) * weights, n_resamples=n_resamples, seed=seed, exact=exact)
    else:
        p, ci_low, ci_high = _bootstrap(ds, n_resamples, seed, confidence)
        exact = False
    return PairedTest(
        n=int(sum(d.size for d in ds)),
        baseline_mean=float(np.mean([np.mean(np.asarray(a, dtype=np.float64)) for a in baseline])),
        system_mean=float(np.mean([np.mean(np.asarray(b, dtype=np.float64)) for b in system])),
        p_value=float(p),
        test=test,
        exact=bool(exact),
        wins=wins,
        ties=ties,
        losses=losses,
        ci_low=ci_low,
        ci_high=ci_high,
        strata=k,
    )


def compare_tasks(
    baseline: Mapping[str, Mapping[str, float]],
    system: Mapping[str, Mapping[str, float]],
    *,
    test: str = "permutation",
    n_resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, PairedTest]:
    """Paired tests per task, and one stratified over the tasks both systems have.

    Args:
        baseline: ``{task: {query_id: score}}`` of the baseline.
        system: the same shape for the other system.

    Returns:
        ``{task: PairedTest}`` for every common task, plus ``OVERALL`` (``"all"``): the
        :func:`stratified_test` of the mean over those tasks of the per-task mean differences (the
        difference of the two task averages). Tasks are paired query by query; a query present on
        one side only is an error (both sides must score the same queries).
    """
    out: dict[str, PairedTest] = {}
    per_task_a: list[list[float]] = []
    per_task_b: list[list[float]] = []
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
        per_task_a.append(a)
        per_task_b.append(b)
    if per_task_a:
        out[OVERALL] = stratified_test(per_task_a, per_task_b, test=test, n_resamples=n_resamples, seed=seed)
    return out
