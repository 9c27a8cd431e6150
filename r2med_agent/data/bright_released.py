"""BRIGHT's released reasoning queries (``run --generations bright``): the ``<llm>_reason``
configurations of the hub repo ``xlangai/BRIGHT`` (GPT-4, Claude-3-Opus, Llama-3-70B, Gemini-1.0,
GritLM), each the examples with ``query`` replaced by that LLM's reasoning about it, read for a
BRIGHT task from its BRIGHT-layout ``--data-dir`` folder or from the hub at the task's pinned
revision, and turned into generations with no LLM built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from r2med_agent.data.bright import EXAMPLES, REASONING_MODELS, read_reasoning_queries, reasoning_config, split_files
from r2med_agent.errors import DataError


def locate_reasoning(task_name: str, model: str, data_dir: str | Path | None = None) -> tuple[list[Path], str]:
    """The files of BRIGHT's released ``model`` reasoning queries for a BRIGHT task, and their
    provenance: ``<model>_reason/<split>*`` in the task's BRIGHT-layout folder (``--data-dir``), else
    the hub repo at the task's pinned revision (one file downloaded and cached).

    Raises:
        DataError: not a BRIGHT task, or no such file (where it was looked for named).
        HubUnavailableError: it must come from the hub, which cannot be reached.
    """
    from r2med_agent.data.load import _locate
    from r2med_agent.data.registry import get_task_spec

    spec = get_task_spec(task_name)
    split = spec.bright
    config = reasoning_config(model)
    if split is None:
        raise DataError(f"task {spec.name} is not a BRIGHT task: BRIGHT released reasoning queries for its own "
                        "tasks only (bright-all); use --generations fresh")
    known = f"BRIGHT released those of {', '.join(REASONING_MODELS)}"
    if data_dir is not None:
        folder = _locate(Path(data_dir).expanduser(), spec)
        files = split_files(folder, config, split.split)
        if not files:
            raise DataError(f"no {config}/{split.split}.parquet (or its shards, or .jsonl) in this BRIGHT-layout "
                            f"folder: {spec.name} has no released reasoning queries of {model} here ({known})", folder)
        return files, str(files[0].resolve())
    from r2med_agent.data.hub import fetch_file

    rel = f"{config}/{split.split}-00000-of-00001.parquet"
    hint = f"{config}/ with {split.split} files beside {EXAMPLES}/ (a copy of {spec.repo})"
    path = fetch_file(spec.repo, spec.revision, rel, hint=hint)
    if path is None:
        raise DataError(f"the hub repo {spec.repo}@{spec.revision} has no {rel}: no released reasoning queries of "
                        f"{model} for {spec.name} at the pinned revision ({known}); use --generations fresh")
    return [path], f"hf://datasets/{spec.repo}@{spec.revision}/{rel}"


def load_reasoning_generations(task: Any, model: str, data_dir: str | Path | None = None):
    """BRIGHT's released ``model`` reasoning query of every query of ``task``, in its order, as
    generations whose final text is the whole reasoning (BRIGHT searches with all of it), and the
    files' provenance.

    Raises:
        DataError: no file, a malformed one, or queries of the task without a row (all named).
    """
    from r2med_agent.types import Generation

    files, source = locate_reasoning(task.name, model, data_dir)
    rows = read_reasoning_queries(files)
    missing = [q.query_id for q in task.queries if q.query_id not in rows]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise DataError(f"no released {model} reasoning query for {len(missing)} of the {len(task.queries)} "
                        f"queries of {task.name} (ids {shown}); use --generations fresh to generate them", files[0])
    return [Generation(text=rows[q.query_id], final=rows[q.query_id]) for q in task.queries], source
