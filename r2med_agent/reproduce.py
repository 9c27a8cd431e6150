"""Reproduction grids (the code lives in :mod:`r2med_agent.analysis`: ``grids``, ``needs`` and
``planner``); this module keeps their names importable from one place."""

from __future__ import annotations

from r2med_agent.analysis.grids import (  # noqa: F401
    BYTES_PER_PARAM,
    GPU_GIB,
    RELEASED_FILE,
    RUN_ARGS,
    TABLES,
    Grid,
    GridEntry,
    PublishedName,
    load_grid,
    load_grids,
    released_llms,
)
from r2med_agent.analysis.needs import (  # noqa: F401
    EXPANSION_PROMPT_TOKENS,
    TOKENS_PER_WORD,
    VLLM_TRANSFORMERS,
    ModelInfo,
    Needs,
    Registries,
    dataset_repos,
    entry_needs,
    load_models,
    model_precision,
    split_recipe,
    token_estimate,
    weights_gib,
)
from r2med_agent.analysis.planner import (  # noqa: F401
    PlannedRun,
    ReproduceOptions,
    format_plan,
    unlisted_published,
    plan,
    reproduce,
    results_table,
    spec_differences,
    stale_reason,
    task_option,
)

__all__ = ['BYTES_PER_PARAM', 'EXPANSION_PROMPT_TOKENS', 'GPU_GIB', 'Grid', 'GridEntry', 'ModelInfo', 'Needs', 'PlannedRun', 'PublishedName', 'RELEASED_FILE', 'RUN_ARGS', 'Registries', 'ReproduceOptions', 'TABLES', 'TOKENS_PER_WORD', 'VLLM_TRANSFORMERS', 'dataset_repos', 'entry_needs', 'format_plan', 'load_grid', 'load_grids', 'load_models', 'model_precision', 'plan', 'released_llms', 'reproduce', 'results_table', 'spec_differences', 'split_recipe', 'stale_reason', 'task_option', 'token_estimate', 'unlisted_published', 'weights_gib']
