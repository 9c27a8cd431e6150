"""Task data: the task registry (R2MED, NanoR2MED, BRIGHT, the shipped samples) and task loading with
validation.

:func:`load_task` reads a task from, in order of preference, a local ``data_dir``, the package
(``sample``, ``r2med-demo``) or the Hugging Face hub. One job per module:

* :mod:`~r2med_agent.data.registry`: :class:`TaskSpec` (``configs/tasks.yaml``), task names,
  aliases and groups, the entry of a task of your own;
* :mod:`~r2med_agent.data.load`: :func:`load_task` (a task by name: where its files are, and the
  registry's counts);
* :mod:`~r2med_agent.data.formats`: :func:`load_task_dir` and the R2MED, BEIR and Nano layout
  readers (the layouts are described there);
* :mod:`~r2med_agent.data.records`: record parsing and validation shared by the readers;
* :mod:`~r2med_agent.data.qrels`: qrels files (:func:`read_qrels_file`) and their checks;
* :mod:`~r2med_agent.data.snapshot`: the task cache under ``cache_dir()/tasks/``;
* :mod:`~r2med_agent.data.nano`: NanoR2MED's candidate rankings (:func:`read_nano_candidates`);
* :mod:`~r2med_agent.data.hub`: dataset snapshots from the Hugging Face hub, failing fast;
* :mod:`~r2med_agent.data.released`: R2MED's released generations (``run --generations r2med``);
* :mod:`~r2med_agent.data.bright`: BRIGHT's layout, its excluded ids and its released reasoning
  queries (``run --generations bright``).

Every problem in the files raises :class:`~r2med_agent.errors.DataError` naming the file and line.
"""

from __future__ import annotations

from r2med_agent.data.bright import excluded_depth, ranking_depth, remove_excluded, task_metrics
from r2med_agent.data.formats import NANO_CONFIGS, R2MED_HUB_FILES, corpus_fingerprint, data_fingerprint, load_task_dir
from r2med_agent.data.load import load_task
from r2med_agent.data.nano import NANO_CANDIDATE_SUBSETS, read_nano_candidates
from r2med_agent.data.qrels import read_qrels_file, read_qrels_jsonl
from r2med_agent.data.registry import (
    GROUPS,
    LOCAL_DOMAIN,
    LOCAL_FAMILY,
    REFERENCE_NAMES,
    TaskSpec,
    base_task_name,
    get_task_spec,
    list_tasks,
    local_task_names,
    local_task_spec,
    reference_name,
    task_names,
    task_registry,
)

__all__ = [
    "GROUPS",
    "LOCAL_DOMAIN",
    "LOCAL_FAMILY",
    "NANO_CANDIDATE_SUBSETS",
    "NANO_CONFIGS",
    "R2MED_HUB_FILES",
    "REFERENCE_NAMES",
    "TaskSpec",
    "base_task_name",
    "corpus_fingerprint",
    "data_fingerprint",
    "excluded_depth",
    "get_task_spec",
    "list_tasks",
    "local_task_names",
    "local_task_spec",
    "load_task",
    "load_task_dir",
    "read_nano_candidates",
    "read_qrels_file",
    "ranking_depth",
    "read_qrels_jsonl",
    "reference_name",
    "remove_excluded",
    "task_metrics",
    "task_names",
    "task_registry",
]
