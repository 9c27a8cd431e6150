"""The shape of single-shot query-expansion methods (HyDE, Query2Doc, LameR) and the plain query.

An expansion method is split in two halves around the LLM so that the runner can send the prompts
of every task in ONE ``llm.generate`` call: ``build_prompts`` renders one conversation per query,
``to_requests`` turns the generations back into :class:`SearchRequest` records whose ``combine``
rule tells the retriever how to mix the query and the generated text (the table of docs/protocol.md).
Methods never call the LLM or a retriever themselves and never write files.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace

from r2med_agent.prompts import templates as prompts
from r2med_agent.types import Combine, Generation, Message, Query, Run, SamplingParams, SearchRequest, Task

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# The one protocol every method implements


@dataclass(frozen=True)
class MethodJob:
    """One task given to a method.

    Attributes:
        task: the task whose queries the method answers.
        retriever: what the method searches while it works (agentic loops); the run's retriever
            unless ``--loop-retriever`` names another.
        final_retriever: the retriever of the final ranking (what ``fuse`` searches with).
        first_pass: makes the first-pass run a prompt shows (methods that need one); called at
            most once.
    """

    task: Task
    retriever: Any
    final_retriever: Any
    first_pass: Callable[[], Run] | None = None


@dataclass(frozen=True)
class MethodSettings:
    """The run's settings a method reads (all from the run spec and the LLM's registry entry).

    Attributes:
        params: the LLM's default sampling with the run's overrides applied (None without an LLM).
        sampling: the run's sampling overrides alone (the loops merge them with their own).
        llm_spec: the LLM's registry entry (None without an LLM).
        samples: generations per query.
        final: the agentic final ranking (``default`` or ``fuse``).
        top_k: documents kept per query.
        prompts_dir: the prompts folder the method renders from (an authors' templates folder,
            or a folder of the user's own over the package's); None: the method's own setting
            (``$R2MED_PROMPTS_DIR`` or the package).
    """

    params: SamplingParams | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    llm_spec: Any = None
    samples: int = 1
    final: str = "default"
    top_k: int = 100
    prompts_dir: Path | None = None


@dataclass
class TaskOutput:
    """What a method made for one task: the final search requests (one per query, in query
    order) and whatever the result files keep beside them.

    Attributes:
        requests: one search request per query.
        generations: the generated texts (one per query), written to ``<Task>.generations.jsonl``.
        samples: every sample per query (``--samples``).
        traces: a loop's trajectories (their token counts join the task's stats).
        fused_run: the final ranking when the method made it itself (``--final fuse``).
        trace_file: how the method writes ``traces`` as its file's text; the runner writes
            what :meth:`artifacts` gives and never reads a trace's format.
    """

    requests: list[SearchRequest]
    generations: list[Generation] | None = None
    samples: list[list[Generation]] | None = None
    traces: list[Any] | None = None
    fused_run: Run | None = None
    trace_file: Callable[[Sequence[Any]], str] | None = None

    def artifacts(self) -> dict[str, str]:
        """The files the method writes beside the task's run, by suffix (``.traces.jsonl``)."""
        if self.traces is None or self.trace_file is None:
            return {}
        return {".traces.jsonl": self.trace_file(self.traces)}


@dataclass
class MethodOutput:
    """Per task, the method's output; ``loop_steps`` holds a loop's per-step call statistics."""

    tasks: dict[str, TaskOutput]
    loop_steps: list[dict[str, int]] | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a method declares about itself; validation, ``reproduce``, ``compare`` and the CLI
    read these instead of the method's name.

    Attributes:
        uses_llm: it generates text (False only for the plain query).
        agentic: it searches while it reasons (a loop over turns).
        supports_samples: several generations per query can be averaged (``--samples``).
        needs_first_pass: its prompt shows a first-pass ranking (``--first-pass``).
        final_fuse: it can rank with every search of its trajectory (``--final fuse``).
    """

    uses_llm: bool = True
    agentic: bool = False
    supports_samples: bool = False
    needs_first_pass: bool = False
    final_fuse: bool = False


def capabilities(method_cls: Any) -> Capabilities:
    """A method class's declared capabilities (attributes of the same names)."""
    return Capabilities(**{f.name: bool(getattr(method_cls, f.name, f.default)) for f in fields(Capabilities)})


class Method:
    """The protocol of every method, and its declared capabilities.

    A method turns each query of each task into a search request, through one call over all
    tasks (so that an LLM sees every prompt of a run at once):
    :meth:`run_tasks` ``(jobs, llm, settings) -> MethodOutput``. For R2MED's released generations,
    :meth:`from_generations` turns one task's generations into its output without an LLM.

    Capabilities are class attributes, read by validation, ``reproduce``, ``compare`` and the CLI
    (never the method's name):

    Attributes:
        name: registry name; also the prompt folder.
        uses_llm: it generates text.
        agentic: it searches while it reasons.
        supports_samples: several generations per query can be averaged (``--samples``).
        needs_first_pass: its prompt shows a first-pass ranking (``--first-pass``).
        first_pass_depth: how many documents of the first pass its prompt shows.
        final_fuse: it can rank with every search of its trajectory (``--final fuse``).
        llm_overrides: LLM entry fields this method changes (Search-o1 sends no system prompt).
        output_format: the reasoning-output format of this method's texts whatever the LLM's
            (Search-R1's ``<answer>`` tags); None: the LLM entry's.
    """

    name: ClassVar[str] = ""
    output_format: ClassVar[str | None] = None
    uses_llm: ClassVar[bool] = True
    agentic: ClassVar[bool] = False
    supports_samples: ClassVar[bool] = False
    needs_first_pass: ClassVar[bool] = False
    first_pass_depth: ClassVar[int] = 0
    final_fuse: ClassVar[bool] = False
    llm_overrides: ClassVar[Mapping[str, Any]] = {}

    def run_tasks(self, jobs: Sequence[MethodJob], llm: Any, settings: MethodSettings) -> MethodOutput:
        raise NotImplementedError

    def from_generations(self, task: Task, generations: Sequence[Generation]) -> TaskOutput:
        raise NotImplementedError

    def sampling(self, llm_spec: Any, overrides: Mapping[str, Any]) -> SamplingParams:
        """The sampling this method's generations use with the run's ``overrides``: the LLM
        entry's defaults with them applied. Two runs whose overrides give the same sampling are
        the same run (the run spec keeps only the overrides that change it)."""
        return replace(llm_spec.sampling_params(), **overrides)


class LoopMethod(Method):
    """The protocol for the agentic loops (their ``run`` batches every query of every task).

    A loop declares what :meth:`run_tasks` reads of it: its own sampling (``params``, and
    ``model_sampling`` for the model it runs), how it adapts to a model (:meth:`for_model`) and to
    a prompts folder (:meth:`with_prompts`), the batched :meth:`run`, and how its traces are
    written (:meth:`trace_file`).
    """

    agentic = True
    final_fuse = True
    params: SamplingParams
    """Sampling of the loop's reasoning steps before the run's overrides."""
    model_sampling: Mapping[str, Any] = {}
    """The original method's sampling for the model it runs (``for_model``), below the run's overrides."""

    def for_model(self, model: str) -> LoopMethod:
        """This loop as the original method runs ``model`` (the registry entry's model id)."""
        return self

    def with_prompts(self, prompts_dir: Path) -> LoopMethod:
        """This loop rendering its prompts from ``prompts_dir``."""
        raise NotImplementedError

    def run(self, tasks_and_retrievers: Sequence[tuple[Task, Any]], llm: Any, *, final: str | None = None,
            top_k: int | None = None, sampling: Mapping[str, Any] | None = None,
            final_retrievers: Sequence[Any] | None = None) -> Mapping[str, Any]:
        """Every query of every task in one batched loop: ``{task name: result}``, each result
        with ``requests``, ``traces``, ``fused_run`` and ``steps``."""
        raise NotImplementedError

    def trace_file(self, traces: Sequence[Any]) -> str:
        """The text of the task's traces file (``<Task>.traces.jsonl``): one JSON line per trace."""
        from r2med_agent.traces import traces_to_jsonl

        return traces_to_jsonl(traces)

    def run_tasks(self, jobs: Sequence[MethodJob], llm: Any, settings: MethodSettings) -> MethodOutput:
        method = self.for_model(settings.llm_spec.model) if settings.llm_spec is not None else self
        if settings.prompts_dir is not None:
            method = method.with_prompts(settings.prompts_dir)
        results = method.run(
            [(j.task, j.retriever) for j in jobs], llm, final=settings.final, top_k=settings.top_k,
            sampling=loop_sampling(method, settings), final_retrievers=[j.final_retriever for j in jobs],
        )
        tasks = {
            name: TaskOutput(list(res.requests), traces=list(res.traces), fused_run=res.fused_run,
                             trace_file=method.trace_file)
            for name, res in results.items()
        }
        steps = next((r.steps for r in results.values()), ())
        return MethodOutput(tasks, [s.to_dict() for s in steps])

    def sampling(self, llm_spec: Any, overrides: Mapping[str, Any]) -> SamplingParams:
        """The sampling of the loop's reasoning steps with the run's ``overrides``
        (:func:`loop_sampling` over the loop for the entry's model)."""
        method = self.for_model(llm_spec.model)
        return replace(method.params, **loop_sampling(method, MethodSettings(sampling=overrides, llm_spec=llm_spec)))

    def from_generations(self, task: Task, generations: Sequence[Generation]) -> TaskOutput:
        """Released final responses, combined with the query as the loop combines them."""
        requests = [SearchRequest(q.query_id, q.text, g.final, "reasoning") for q, g in zip(task.queries, generations)]
        return TaskOutput(requests, generations=list(generations))


def loop_sampling(method: Any, settings: MethodSettings) -> dict[str, Any]:
    """The loops' sampling: the run's overrides win, then the method's own for the model
    (Search-R1 greedy, Search-o1 0.7/0.8/20; with QwQ a repetition penalty of 1.05 and 20,480
    tokens), then the entry's seed (null: none sent), its repetition penalty, and its
    ``max_tokens`` where that is below the method's own budget (a small local model)."""
    sampling = dict(settings.sampling)
    for name, value in method.model_sampling.items():
        sampling.setdefault(name, value)
    spec = settings.llm_spec
    if spec is not None:
        sampling.setdefault("seed", spec.seed)
        if getattr(spec, "repetition_penalty", 1.0) != 1.0:
            sampling.setdefault("repetition_penalty", spec.repetition_penalty)
        if spec.max_tokens < method.params.max_tokens:
            sampling.setdefault("max_tokens", spec.max_tokens)
    return sampling


def _base_task(name: str) -> str:
    """The full R2MED task behind ``name``, or ``name`` itself for a task the registry does not know."""
    from r2med_agent.data import base_task_name
    from r2med_agent.errors import ConfigError

    try:
        return base_task_name(name)
    except ConfigError:
        return name


class ExpansionMethod(Method):
    """Base class of the single-shot expansion methods.

    A subclass sets the class attributes and, when its template needs more than the query and
    the task's domain, overrides :meth:`template_variables`.

    Attributes:
        name: registry name; also the prompt folder (``prompts/<name>/<family>.j2``).
        combine: the SearchRequest rule for this method's generations.
        needs_first_pass: True when ``build_prompts`` needs a first-pass run (LameR).
        uses_llm: False only for the plain-query method.

    :meth:`run_tasks` renders the prompts of every task, makes ONE generate call (or one
    ``generate_samples`` call with ``samples`` > 1) and turns the generations into requests.
    """

    combine: ClassVar[Combine]
    supports_samples = True

    def __init__(self, prompts_dir: str | os.PathLike[str] | None = None) -> None:
        """Create the method.

        Args:
            prompts_dir: a folder of prompt files overriding the package's files of the same
                name (default: ``$R2MED_PROMPTS_DIR`` if set, else the package's own prompts).
        """
        self.prompts_dir: Path | None = Path(prompts_dir) if prompts_dir is not None else None

    def template_path(self, task: Task) -> str:
        """The template this method renders for ``task``: ``<name>/<family>.j2``."""
        return f"{self.name}/{task.family}.j2"

    def template_variables(self, task: Task, first_pass: Run | None) -> list[dict[str, Any]]:
        """The template variables of every query, in ``task.queries`` order.

        The base gives ``query`` (the query text), ``domain``, ``family`` and ``task`` (the
        full R2MED task behind the task's name, ``nano-Biology`` -> ``Biology``; a task of your
        own keeps its name: imported per-task prompts choose their text by it).
        """
        return [self._base_variables(task, q) for q in task.queries]

    @staticmethod
    def _base_variables(task: Task, query: Query) -> dict[str, Any]:
        return {"query": query.text, "domain": task.domain, "family": task.family, "task": _base_task(task.name)}

    def build_prompts(self, task: Task, first_pass: Run | None = None) -> list[list[Message]]:
        """One conversation per query of ``task``, in ``task.queries`` order.

        Each conversation is the user message only; the LLM backend adds the registry's system
        prompt. Trailing whitespace of the rendered template is dropped, except from a template
        that renders exactly (an imported reference prompt, :func:`~r2med_agent.prompts.templates.renders_exactly`).

        Args:
            task: the task whose queries get prompts.
            first_pass: a first-pass run over ``task`` (required when ``needs_first_pass``).

        Raises:
            ValueError: ``first_pass`` is missing for a method that needs it.
            ConfigError: the template is missing, broken, or needs a variable not given.
        """
        if self.needs_first_pass and first_pass is None:
            raise ValueError(f"method '{self.name}' needs a first-pass run (first_pass=None given)")
        path = self.template_path(task)
        exact = prompts.renders_exactly(path, prompts_dir=self.prompts_dir)
        out = []
        for v in self.template_variables(task, first_pass):
            text = prompts.render(path, prompts_dir=self.prompts_dir, **v)
            out.append([{"role": "user", "content": text if exact else text.rstrip()}])
        return out

    def template_hash(self, task: Task) -> str:
        """Hash of the template files (and examples) behind this task's prompts; changes on edit."""
        return prompts.template_hash(self.name, task.family, prompts_dir=self.prompts_dir)

    def to_requests(self, task: Task, generations: Sequence[Generation]) -> list[SearchRequest]:
        """Search requests from the generations, one per query, in ``task.queries`` order.

        The expansion is ``Generation.final`` (the response after reasoning-output parsing) as
        it is, surrounding whitespace included, as R2MED's scripts use it. An empty one is
        logged with the query's id and kept: the retrievers search with the plain query instead
        unless the run keeps empty generations (``empty_generation: keep``).

        Raises:
            ValueError: the number of generations differs from the number of queries.
        """
        if len(generations) != len(task.queries):
            raise ValueError(
                f"{task.name}: {len(generations)} generations for {len(task.queries)} queries"
            )
        out: list[SearchRequest] = []
        for query, gen in zip(task.queries, generations):
            if not gen.final.strip():
                log.warning(
                    "%s: empty %s generation for query %s (finish_reason=%s)",
                    task.name, self.name, query.query_id, gen.finish_reason,
                )
            out.append(SearchRequest(query.query_id, query.text, gen.final, self.combine))
        return out

    def run_tasks(self, jobs: Sequence[MethodJob], llm: Any, settings: MethodSettings) -> MethodOutput:
        """Render every task's prompts, make ONE generate call, turn the texts into requests."""
        if settings.prompts_dir is not None and settings.prompts_dir != self.prompts_dir:
            method = copy.copy(self)
            method.prompts_dir = Path(settings.prompts_dir)
            return method.run_tasks(jobs, llm, replace(settings, prompts_dir=None))
        prompts_all: list[list[Message]] = []
        metas: list[dict[str, Any]] = []
        hashes: list[str] = []  # one per prompt: part of each generation's cache key
        spans: dict[str, tuple[int, int]] = {}
        for job in jobs:
            task = job.task
            first_pass = job.first_pass() if self.needs_first_pass and job.first_pass is not None else None
            task_prompts = self.build_prompts(task, first_pass)
            spans[task.name] = (len(prompts_all), len(prompts_all) + len(task_prompts))
            prompts_all.extend(task_prompts)
            metas.extend(
                {"task": task.name, "query_id": q.query_id, "method": self.name, "text": q.text,
                 "doc_id": sorted(task.qrels.get(q.query_id, {}))}
                for q in task.queries
            )
            hashes.extend([self.template_hash(task)] * len(task_prompts))
        if settings.samples > 1:
            samples = llm.generate_samples(prompts_all, settings.params, settings.samples, meta=metas,
                                           template_hash=hashes)
            gens = [s[0] for s in samples]
        else:
            gens = llm.generate(prompts_all, settings.params, meta=metas, template_hash=hashes)
            samples = [[g] for g in gens]
        out: dict[str, TaskOutput] = {}
        for job in jobs:
            a, b = spans[job.task.name]
            output = self.from_generations(job.task, gens[a:b])
            if settings.samples > 1:
                # Samples 2..N join the first; a blank first sample leaves the plain query as is.
                output.requests = [
                    replace(r, more_expansions=tuple(g.final.strip() for g in s[1:])) if r.expansion.strip() else r
                    for r, s in zip(output.requests, samples[a:b])
                ]
                output.samples = samples[a:b]
            out[job.task.name] = output
        return MethodOutput(out)

    def from_generations(self, task: Task, generations: Sequence[Generation]) -> TaskOutput:
        """One task's output from its generations (fresh or released)."""
        return TaskOutput(self.to_requests(task, generations), generations=list(generations))


class NoneMethod(ExpansionMethod):
    """The plain query: no prompts, no LLM, ``combine="none"``."""

    name = "none"
    combine = "none"
    uses_llm = False
    supports_samples = False

    def run_tasks(self, jobs: Sequence[MethodJob], llm: Any, settings: MethodSettings) -> MethodOutput:
        """Every query as it is; no LLM."""
        return MethodOutput({j.task.name: TaskOutput(self.to_requests(j.task)) for j in jobs})

    def template_variables(self, task: Task, first_pass: Run | None) -> list[dict[str, Any]]:
        return []

    def build_prompts(self, task: Task, first_pass: Run | None = None) -> list[list[Message]]:
        return []

    def template_hash(self, task: Task) -> str:
        return ""

    def to_requests(self, task: Task, generations: Sequence[Generation] = ()) -> list[SearchRequest]:
        """One plain-query request per query.

        Raises:
            ValueError: generations were given (this method makes none).
        """
        if generations:
            raise ValueError(f"method 'none' takes no generations, got {len(generations)}")
        return [SearchRequest(q.query_id, q.text) for q in task.queries]
