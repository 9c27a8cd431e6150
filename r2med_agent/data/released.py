"""R2MED's released generations: the LLM outputs behind the paper's rows, scored without any LLM.

Every R2MED hub dataset repo (``R2MED/<task>``) ships, next to its data, the generations of the
paper's runs as ``<method>/<llm>/query_with_hydoc.jsonl`` (rows ``id``, ``text``, ``hy_doc``,
``doc_id``; ``hy_doc`` is the raw model output, reasoning included). ``run --generations r2med``
reads the task's file instead of building an LLM, from the first of:

- ``--data-dir``: the same layout inside the task's folder (``<Task>/hyde/qwen-7b/...``);
- a packaged task (``r2med-demo`` ships one such file);
- the hub: the task's repo at its pinned revision (a NanoR2MED task: its full R2MED task's repo,
  whose query ids it shares), one file downloaded and cached.

The ``<llm>`` folder is the LLM's registry name (``qwen-7b``, ``r1-qwen-32b``, ``qwen-3b-ins``),
as R2MED names its folders. Each text goes through the same parsing (the LLM's reasoning format;
Search-R1: the ``<answer>`` span) and the same query construction as a fresh generation. Results
made this way live under ``<method>/<llm>@r2med/`` and record ``"generations": "r2med"``, so the
two kinds never mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from r2med_agent.errors import ConfigError, DataError
from r2med_agent.names import released_label  # noqa: F401 - the folder name of released generations, named here too
from r2med_agent.types import Generation, SearchRequest, Task

GENERATIONS = ("fresh", "r2med", "bright")
"""``run --generations`` values: generate now, R2MED's released generations, or BRIGHT's released
reasoning queries (:func:`r2med_agent.data.bright_released.load_reasoning_generations`)."""

RELEASED_FILE = "query_with_hydoc.jsonl"

RELEASED_SUFFIX = "@r2med"
"""Appended to the LLM part of a result folder made from released generations."""

RELEASED_SUFFIXES = ("@r2med", "@bright")
"""The suffixes of each release's results (``<llm>@r2med``, ``<llm>@bright``)."""


def check_generations(value: str) -> str:
    if value not in GENERATIONS:
        raise ConfigError(f"--generations must be one of {', '.join(GENERATIONS)}, got '{value}'")
    return value


def released_path(method: str, llm: str) -> str:
    """The file's path inside a task folder or hub repo: ``<method>/<llm>/query_with_hydoc.jsonl``."""
    return f"{method}/{llm}/{RELEASED_FILE}"


def base_llm(label: str) -> str:
    """``qwen-7b@r2med`` -> ``qwen-7b``, ``gpt4@bright`` -> ``gpt4`` (other labels unchanged)."""
    for suffix in RELEASED_SUFFIXES:
        if label.endswith(suffix):
            return label[: -len(suffix)]
    return label


def is_released_label(label: str) -> bool:
    return label.endswith(RELEASED_SUFFIXES)


def locate(task_name: str, method: str, llm: str, data_dir: str | Path | None = None) -> tuple[Path, str]:
    """The local file of ``task_name``'s released ``method``/``llm`` generations and its provenance.

    Raises:
        DataError: the file does not exist (the message names where it was looked for).
        HubUnavailableError: it must come from the hub, which cannot be reached.
    """
    from r2med_agent.data.load import _locate
    from r2med_agent.data.registry import get_task_spec
    from r2med_agent.paths import resources_dir

    spec = get_task_spec(task_name)
    rel = released_path(method, llm)
    fresh = "or run with --generations fresh to generate them"
    if data_dir is not None:
        folder = _locate(Path(data_dir).expanduser(), spec)
        path = folder / rel
        if not path.is_file():
            raise DataError(
                f"no released {method} generations of {llm} for task {spec.name}: expected {rel} "
                f"in this task folder; copy it from the hub repo {spec.repo or 'R2MED/<task>'}, {fresh}",
                folder,
            )
        return path, str(path.resolve())
    if spec.source == "package":
        path = resources_dir() / spec.path / rel
        if not path.is_file():
            raise DataError(
                f"the packaged task {spec.name} has no released {method} generations of {llm} "
                f"(no {rel}); {fresh}"
            )
        return path, f"package:{spec.path}/{rel}"
    repo_spec = get_task_spec(spec.base) if spec.source == "nano" and spec.base else spec
    if repo_spec.source != "hub":
        raise DataError(f"task {spec.name} has no R2MED hub repo to take released generations from; {fresh}")
    from r2med_agent.data.hub import fetch_file

    hint = f"{repo_spec.name}/{rel} (a copy of {repo_spec.repo}'s file)"
    path = fetch_file(repo_spec.repo, repo_spec.revision, rel, hint=hint)
    where = f"{repo_spec.repo}@{repo_spec.revision}"
    if path is None:
        raise DataError(
            f"the hub repo {where} has no {rel}: R2MED released no {method} generations of {llm} "
            f"for {repo_spec.name} at the pinned revision; {fresh}"
        )
    return path, f"hf://datasets/{where}/{rel}"


def read_rows(path: Path) -> dict[str, str]:
    """``{query id: hy_doc}`` of a ``query_with_hydoc.jsonl`` file.

    Raises:
        DataError: malformed JSON, a row without ``id`` or a string ``hy_doc``, a repeated id
            (each names the file and line).
    """
    from r2med_agent.io import iter_jsonl

    rows: dict[str, str] = {}
    for lineno, obj in iter_jsonl(path):
        if "id" not in obj or not isinstance(obj.get("hy_doc"), str):
            raise DataError("a released generation needs 'id' and a string 'hy_doc'", path, lineno)
        qid = str(obj["id"])
        if qid in rows:
            raise DataError(f"query id {qid!r} appears twice", path, lineno)
        rows[qid] = obj["hy_doc"]
    return rows


def check_samples(task_names: Sequence[str], method: str, llm: str, samples: int,
                  data_dir: str | Path | None = None) -> None:
    """Refuse ``--samples`` above 1 with released generations, before any other work: R2MED
    released one text per query (a file's ids are unique), so a run that averaged "samples" would
    score that one text under a label claiming more.

    Raises:
        ConfigError: ``samples`` > 1; the message names the first task's file and its counts.
        DataError, HubUnavailableError: the file cannot be found or read (as :func:`locate`).
    """
    if samples <= 1 or not task_names:
        return
    path, source = locate(task_names[0], method, llm, data_dir)
    texts = len(read_rows(path))
    raise ConfigError(
        f"--samples {samples} with --generations r2med: {source} holds {texts} released texts, one per "
        f"query ({texts} queries), not the {samples} per query ({samples * texts} texts) that --samples "
        f"{samples} would average; R2MED released one generation of each query. Use --samples 1 to score "
        f"them, or --generations fresh to generate {samples} per query with --llm {llm}"
    )


def load_generations(
    task: Task, method: str, llm: str, reasoning_format: str, data_dir: str | Path | None = None
) -> tuple[list[Generation], str]:
    """The released generations of every query of ``task``, in ``task.queries`` order, parsed with
    ``reasoning_format`` (the caller passes the method's own output format where it has one,
    Search-R1's ``<answer>`` span, else the LLM's), and the file's provenance.

    Raises:
        DataError: no file, a malformed one, or queries of the task without a row (all named).
    """
    from r2med_agent.llm.parsing import split_reasoning

    path, source = locate(task.name, method, llm, data_dir)
    rows = read_rows(path)
    missing = [q.query_id for q in task.queries if q.query_id not in rows]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise DataError(
            f"no released generation for {len(missing)} of the {len(task.queries)} queries of "
            f"{task.name} (ids {shown}); run with --generations fresh to generate them",
            path,
        )
    gens = []
    for q in task.queries:
        text = rows[q.query_id]
        reasoning, final = split_reasoning(text, reasoning_format)
        gens.append(Generation(text=text, final=final, reasoning=reasoning, finish_reason="stop"))
    return gens, source


def agentic_requests(task: Task, generations: Sequence[Generation]) -> list[SearchRequest]:
    """An agentic method's final requests from released final responses, exactly as its loop
    builds them (the query and the response, combined by the reasoning rule)."""
    return [SearchRequest(q.query_id, q.text, g.final, "reasoning") for q, g in zip(task.queries, generations)]
