"""Score your own encoder, retriever or LLM from Python, through the same runner as the CLI.

Each function runs one configuration over one or more tasks and returns the runner's
:class:`~r2med_agent.experiment.runner.ExperimentResult`. The results land in the usual result tree
(``<output_dir>/<method>/<llm>/<retriever>/<Task>.json``, ``.run``, ...), so ``r2med-agent
compare`` and ``report`` read them beside every other run, and generations of your LLM go
through the generation cache like any other model's (a re-run makes no call).

- :func:`evaluate_encoder` takes an encoder object as R2MED's README asks for (``CustomModel``
  with ``encode_queries(queries, batch_size=...)`` and ``encode_corpus(corpus, batch_size=...)``,
  ``corpus`` a list of ``{"title", "text"}`` dicts), an object with ``encode(texts)`` as MTEB and
  sentence-transformers take, or a plain function from a list of texts to vectors. Scores are
  cosine similarities over the exact top ``top_k``; expansions combine as for every dense
  retriever (see docs/protocol.md). Its document embeddings are not cached on disk (a name
  cannot tell two versions of your model apart).
- :func:`evaluate_retriever` takes ``search(corpus, queries, k)`` as BEIR's search classes do:
  ``corpus`` maps document id to text, ``queries`` query id to the query text, and it returns
  ``{query_id: {doc_id: score}}``.
- :func:`evaluate_llm` takes ``generate(prompts)``: a list of chat conversations (lists of
  ``{"role", "content"}`` dicts) in, one output string per conversation out.

Documents are seen as ``Doc.full_text`` (title + " " + text) everywhere.

``tasks`` is named as ``run`` names it: with ``data_dir`` and no ``tasks``, the task(s) in that
folder, each named after its folder; without either, the packaged ``sample``. Errors are the
CLI's ConfigError and DataError, with each option named as the keyword these functions take
(``allow_count_mismatch=True``, ``data_dir``), not as its CLI flag.

The module is also the public Python API of ``run``, ``compare`` and ``reproduce``
(docs/python-api.md): :class:`RunConfig`, :func:`run_experiment`, :func:`load_results`,
:func:`build_table`, :func:`resolve` (a spec into its :class:`RunPlan`), :func:`load_grid`,
:func:`plan` (a grid's rows), :func:`reproduce` and the rest of
``_PUBLIC``, each imported from the module that defines it on first use, so importing this
module never loads the whole pipeline.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent.errors import ConfigError, DataError, LLMError
from r2med_agent.types import Generation, Message, Run, SamplingParams, SearchRequest, Task

log = logging.getLogger(__name__)

# The public names of run, compare and reproduce, and the module each is defined in.
_PUBLIC = {
    "r2med_agent.experiment.run_config": ("RunConfig",),
    "r2med_agent.experiment.runner": ("ExperimentResult", "TaskOutcome", "run_experiment"),
    "r2med_agent.experiment.spec": ("DEFAULT_TOP_K", "RunSpec"),
    "r2med_agent.experiment.resolve": ("resolve",),
    "r2med_agent.experiment.plan": ("RunPlan",),
    "r2med_agent.analysis.published": ("PublishedKey", "PublishedResults", "published_results"),
    "r2med_agent.analysis.render": ("FORMATS", "print_rich", "render"),
    "r2med_agent.analysis.results": ("ResultRow", "TaskResult", "load_results"),
    "r2med_agent.analysis.tables": ("ComparisonTable", "TableOptions", "TableRow", "build_table", "find_row"),
    "r2med_agent.grids.grid": ("TABLES", "Grid", "GridEntry", "load_grid", "load_grids"),
    "r2med_agent.grids.planner": ("PlannedRun", "ReproduceOptions", "format_plan", "plan", "reproduce",
                                  "results_table"),
}
_HOME = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = ["PythonLLM", "evaluate_encoder", "evaluate_llm", "evaluate_retriever", *sorted(_HOME)]


def __getattr__(name: str) -> Any:
    """``from r2med_agent.api import RunConfig``: the name from the module that defines it."""
    if name in _HOME:
        import importlib

        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'r2med_agent.api' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))

_LLM_FUNCTIONS: dict[str, Callable[[list[list[Message]]], Sequence[str]]] = {}


# --------------------------------------------------------------------------- encoders


def _to_matrix(vectors: Any, n: int, who: str) -> np.ndarray:
    """Vectors from numpy, torch (any device) or lists as an ``(n, dim)`` float32 array."""
    if hasattr(vectors, "detach"):  # a torch tensor
        vectors = vectors.detach().float().cpu().numpy()
    arr = np.asarray(vectors, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise ConfigError(f"{who} returned an array of shape {arr.shape} for {n} texts; "
                          f"expected ({n}, dim)")
    return arr


class UserEncoder:
    """Adapts a user's encoder object or function to the framework's encoder protocol."""

    def __init__(self, model: Any, name: str, batch_size: int = 64) -> None:
        from r2med_agent.retrieval.dense.spec import EncoderSpec

        self.model = model
        self.name = name
        self.batch_size = batch_size
        # No instructions, no prefixes: the user's model encodes the texts as given.
        self.spec = EncoderSpec(name=name, model=f"python:{name}", normalize=True)
        if not (hasattr(model, "encode_queries") and hasattr(model, "encode_corpus")) \
                and not hasattr(model, "encode") and not callable(model):
            raise ConfigError(
                f"encoder '{name}': expected an object with encode_queries/encode_corpus "
                "(R2MED's CustomModel), an object with encode(texts) (MTEB, "
                "sentence-transformers), or a function from a list of texts to vectors"
            )

    def encode(self, texts: Sequence[str], *, side: str, prefix: str = "",
               titles: Sequence[str] | None = None) -> np.ndarray:
        texts = [prefix + t for t in texts]
        m = self.model
        if hasattr(m, "encode_queries") and hasattr(m, "encode_corpus"):
            if side == "query":
                out = m.encode_queries(texts, batch_size=self.batch_size)
            else:  # full_text already holds the title: BEIR-style models join it the same way
                out = m.encode_corpus([{"title": "", "text": t} for t in texts],
                                      batch_size=self.batch_size)
            who = f"encoder '{self.name}'.encode_{'queries' if side == 'query' else 'corpus'}"
        elif hasattr(m, "encode"):
            out, who = m.encode(texts), f"encoder '{self.name}'.encode"
        else:
            out, who = m(texts), f"encoder '{self.name}'"
        return _to_matrix(out, len(texts), who)


def evaluate_encoder(
    model: Any,
    name: str,
    tasks: str | Sequence[str] | None = None,
    *,
    batch_size: int = 64,
    **options: Any,
) -> Any:
    """Score a dense encoder of your own on ``tasks``; see the module docstring.

    Args:
        model: the encoder object or function.
        name: its name in result paths (``results/none/none/<name>/``); not a registry name.
        tasks: task names as ``--task`` takes them (``"sample"``, ``"all"``, a list); None: the
            task folders of ``data_dir``, each named after its folder (``sample`` without one).
        batch_size: passed to ``encode_queries``/``encode_corpus``.
        **options: :func:`run_options` (``method``, ``llm``, ``data_dir``, ``output_dir``, ...).
    """
    from r2med_agent.retrieval import register_retriever
    from r2med_agent.retrieval.dense.index import DenseRetriever
    from r2med_agent.retrieval.dense.spec import EncoderOptions

    encoder = UserEncoder(model, name, batch_size)

    def build(task: Task) -> DenseRetriever:
        return DenseRetriever.for_task(task, encoder, EncoderOptions(use_cache=False, show_progress=False))

    # A dense retriever combines an expansion with the query by its embeddings; the user's model
    # is no registry entry, so --precision and --encoder-backend play no part.
    register_retriever(name, build, combine="own")
    return _run(tasks, retriever=name, **options)


# --------------------------------------------------------------------------- retrievers


class UserRetriever:
    """Adapts ``search(corpus, queries, k)`` to the framework's retriever protocol; queries
    built from expansions follow the BM25 column of the query table (a text retriever)."""

    def __init__(self, search: Callable[..., Mapping[str, Mapping[str, float]]], name: str,
                 task: Task) -> None:
        self.search_fn = search
        self.name = name
        self.corpus = {d.doc_id: d.full_text for d in task.corpus}

    def search(self, requests: Sequence[SearchRequest], k: int) -> Run:
        from r2med_agent.retrieval.query import bm25_query_text

        # A ``text`` kind: the registry gives each request as its query text; built outside the
        # registry, the rule is applied here (to a plain request it gives the query itself).
        queries = {r.query_id: bm25_query_text(r) for r in requests}
        got = self.search_fn(self.corpus, queries, k)
        if not isinstance(got, Mapping):
            raise ConfigError(f"retriever '{self.name}' returned {type(got).__name__}; expected "
                              "{query_id: {doc_id: score}}")
        run: Run = {}
        for qid in queries:
            ranking = got.get(qid) or {}
            unknown = [d for d in ranking if d not in self.corpus]
            if unknown:
                raise ConfigError(f"retriever '{self.name}' returned document id {unknown[0]!r} "
                                  f"for query {qid}, which is not in the corpus")
            top = sorted(ranking.items(), key=lambda kv: float(kv[1]), reverse=True)[:k]
            run[qid] = {d: float(s) for d, s in top}
        return run


def evaluate_retriever(
    search: Callable[..., Mapping[str, Mapping[str, float]]],
    name: str,
    tasks: str | Sequence[str] | None = None,
    **options: Any,
) -> Any:
    """Score a retriever of your own: ``search(corpus, queries, k)`` -> ``{qid: {doc_id: score}}``.

    Args:
        search: the function (called once per task with every query of the task).
        name: its name in result paths.
        tasks: as :func:`evaluate_encoder`.
        **options: :func:`run_options`.
    """
    from r2med_agent.retrieval import register_retriever

    register_retriever(name, lambda task: UserRetriever(search, name, task), combine="text")
    return _run(tasks, retriever=name, **options)


# --------------------------------------------------------------------------- LLMs


class PythonLLM:
    """The ``python`` LLM backend: calls a function registered by :func:`evaluate_llm`."""

    def __init__(self, spec: Any) -> None:
        fn = _LLM_FUNCTIONS.get(spec.name)
        if fn is None:
            raise ConfigError(f"llm '{spec.name}' is a Python function; it exists only in the "
                              "process that passed it to r2med_agent.api.evaluate_llm")
        self.fn = fn
        self.model_id = spec.model
        self.name = spec.name

    def generate(self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
                 template_hash: Any = "", meta: Any = None) -> list[Generation]:
        """The user's function over the prompts (the keyword options of the LLM protocol are the
        cache's business, not the function's)."""
        t0 = time.perf_counter()
        texts = list(self.fn([list(p) for p in prompts]))
        if len(texts) != len(prompts) or not all(isinstance(t, str) for t in texts):
            raise LLMError(f"llm '{self.name}' returned {len(texts)} outputs for {len(prompts)} "
                           "prompts; expected one string per prompt")
        each = (time.perf_counter() - t0) / max(1, len(prompts))
        return [Generation(text=t, latency_s=each) for t in texts]


def evaluate_llm(
    generate: Callable[[list[list[Message]]], Sequence[str]],
    name: str,
    tasks: str | Sequence[str] | None = None,
    *,
    method: str = "hyde",
    retriever: str = "bm25",
    reasoning_format: str = "plain",
    temperature: float = 0.0,
    max_tokens: int = 512,
    **options: Any,
) -> Any:
    """Score an LLM of your own as the query writer of ``method`` (HyDE by default).

    Args:
        generate: prompts (chat conversations) in, one string per prompt out, in order.
        name: its name in result paths and in the generation cache (outputs are cached under
            the name, the prompts and the sampling settings: rename it when the model changes).
        tasks: as :func:`evaluate_encoder`.
        method: hyde, query2doc, lamer, search-r1 or search-o1.
        retriever: any ``--retriever`` spec (bm25, an encoder, a registered retriever).
        reasoning_format: how the final response is cut from the output (``plain``, ``r1``, ...).
        temperature, max_tokens: the sampling settings recorded with each generation (your
            function decides what it does with them).
        **options: :func:`run_options`. ``prompts_from`` is ``own`` unless given (the project's
            wording, offline: your function is no paper's model; ``authors`` fetches the authors').
    """
    from r2med_agent.config import register_entry

    register_entry("llms", name, {  # refuses a name that cannot be a folder name
        "backend": "python", "model": f"python:{name}", "reasoning_format": reasoning_format,
        "temperature": temperature, "max_tokens": max_tokens, "system_prompt": "",
        "chunk_size": 0,
    })
    _LLM_FUNCTIONS[name] = generate
    options.setdefault("prompts_from", "own")
    return _run(tasks, retriever=retriever, method=method, llm=name, **options)


# --------------------------------------------------------------------------- shared


def run_options() -> tuple[str, ...]:
    """The keyword options every ``evaluate_*`` function passes to the runner: the fields of
    :class:`~r2med_agent.experiment.run_config.RunConfig` (``data_dir``, ``output_dir``, ``top_k``,
    ``method``, ``llm``, ``use_cache``, ``show_progress``, ...)."""
    import dataclasses

    from r2med_agent.experiment.run_config import RunConfig

    return tuple(f.name for f in dataclasses.fields(RunConfig) if f.init and f.name not in ("tasks", "retriever"))


_FLAG = re.compile(r"--([a-z][a-z0-9-]*)((?: NAME| FOLDER)?)")


def _api_words(message: str) -> str:
    """``message`` with each CLI flag of a run option named as this module's keyword
    (``--allow-count-mismatch`` -> ``allow_count_mismatch=True``, ``--task NAME`` -> ``tasks=NAME``)."""
    import dataclasses

    from r2med_agent.experiment.run_config import RunConfig

    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}

    def keyword(m: re.Match[str]) -> str:
        key = "tasks" if m.group(1) == "task" else m.group(1).replace("-", "_")
        if key not in defaults:
            return m.group(0)
        if defaults[key] is False:
            return f"{key}=True"
        return f"{key}={m.group(2).strip()}" if m.group(2) else key

    return _FLAG.sub(keyword, message)


def _run(tasks: str | Sequence[str] | None, *, retriever: str, **options: Any) -> Any:
    """Run through the runner; its ConfigError and DataError are raised again in this module's
    words (:func:`_api_words`)."""
    try:
        return _run_options(tasks, retriever=retriever, **options)
    except DataError as e:
        err = DataError(_api_words(str(e)))
        err.path, err.line = e.path, e.line
        raise err from None
    except ConfigError as e:
        raise ConfigError(_api_words(str(e))) from None


def _run_options(tasks: str | Sequence[str] | None, *, retriever: str, **options: Any) -> Any:
    from r2med_agent.data import local_task_names, task_names
    from r2med_agent.experiment.run_config import RunConfig
    from r2med_agent.experiment.runner import run_experiment

    unknown = sorted(set(options) - set(run_options()))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(run_options())}")
    data_dir = options.get("data_dir")
    if data_dir is not None:
        options["data_dir"] = Path(data_dir)
    if "output_dir" in options:
        options["output_dir"] = Path(options["output_dir"])
    if tasks is None:  # as `run` without --task
        names = local_task_names(data_dir) if data_dir is not None else ["sample"]
    else:
        spec = tasks if isinstance(tasks, str) else ",".join(tasks)
        names = task_names(spec, data_dir)
    options.setdefault("show_progress", False)
    cfg = RunConfig(tasks=tuple(names), retriever=retriever, **options)
    return run_experiment(cfg)
