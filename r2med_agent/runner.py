"""Running experiments from Python: the public names of :mod:`r2med_agent.experiment`.

A :class:`RunConfig` is a :class:`RunSpec` (every setting that can change a result) plus where
and how to run it; :func:`run_experiment` runs it over its tasks and writes the result files
``compare`` and ``report`` read. See docs/python-api.md.
"""

from __future__ import annotations

from r2med_agent.experiment.run_config import RunConfig
from r2med_agent.experiment.runner import ExperimentResult, TaskOutcome, run_experiment
from r2med_agent.experiment.spec import DEFAULT_TOP_K, RunSpec

__all__ = ["DEFAULT_TOP_K", "ExperimentResult", "RunConfig", "RunSpec", "TaskOutcome", "run_experiment"]
