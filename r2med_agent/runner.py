"""The runner's public names (the runner lives in :mod:`r2med_agent.experiment.runner`)."""

from r2med_agent.experiment.runner import (  # noqa: F401
    DEFAULT_TOP_K,
    FINAL_MODES,
    ExperimentResult,
    RunConfig,
    RunSpec,
    TaskOutcome,
    _config_record,
    cut_run,
    model_precisions,
    run_experiment,
)
