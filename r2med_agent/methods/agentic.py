"""Search-R1 and Search-o1: reasoning-search loops over a task's corpus (docs/protocol.md).

Both run on the batched engine of :mod:`r2med_agent.methods.loop` and return, per task, an
:class:`~r2med_agent.methods.loop.AgenticResult`: the final SearchRequests (``combine="reasoning"``,
the final response as the expansion), the traces, and with ``final="fuse"`` a fused Run.

Search-R1 (its repo's evaluation loop): tags ``<think>``, ``<search>q</search>``,
``<information>...</information>``, ``<answer>a</answer>``; the question stripped, with a ``?``
appended when it has none; generation stops at ``</search>`` (and at ``</answer>``, which only
saves tokens), at most 500 tokens a step; the top-3 documents are inserted as
``Doc i(Title: t) text``, the block cut to 500 tokens of the model's tokenizer; a turn with
neither a search nor an answer (a step cut at 500 tokens included) gets a corrective message;
up to 4 turns that may search, then one final turn in which a search is not run; greedy decoding.
Final response: the ``<answer>`` span; with none, the model's reasoning-output parser applied to
everything the model generated in the trajectory (inserted text excluded), tags removed.

Search-o1 (its repo's ``run_search_o1.py`` and ``prompts.py``): ``<|begin_search_query|>q<|end_search_query|>``;
generation stops at the end-of-query token; the top-10 documents of every search of a step go to
ONE batched Reason-in-Documents call of the same model, as the original's web-page records
(:func:`format_docs_o1`) with the previous steps shortened as it shortens them
(:func:`previous_steps`), and only what the original extracts from its raw output
(:func:`extract_final_information`) is inserted within
``<|begin_search_result|>...<|end_search_result|>``; the model's own context length (the
entry's ``max_model_len`` is not applied);
a repeated query and one over the 10-search limit get the original's fixed notices instead;
a step without a query ends the trajectory; at most 15 turns: a query issued in the 15th is run
and condensed like any other, and the trajectory stops there. Sampling as the original: 0.7,
top_p 0.8, top_k 20, 8,192 tokens per generation; for QwQ (a model id containing ``qwq``)
repetition penalty 1.05 and 20,480 tokens, and its task prompt leaves out the "think step by
step" sentence; Reason-in-Documents always with repetition penalty 1.05. Both requests are one
user message, with no system message (the registry's system prompt is not sent).
Final response: the model's reasoning-output parser applied to everything the model generated in
the trajectory (inserted text excluded), search tokens removed: for R1-style models the text
after the FIRST ``</think>``, even when later steps searched again.

No document id is ever shown to the model (on R2MED's Q&A tasks an id names the question the
document was collected for): Search-R1's ``Title:`` slot gets the document's title when the corpus
has one, else the first line of its text (as Search-R1's repo splits its corpus), and Search-o1's
records carry the document's rank as their ``id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from r2med_agent.errors import ConfigError
from r2med_agent.methods.loop import FINAL_MODES, FinalRanking, LoopLimits, ReasoningLoop
from r2med_agent.methods.loop_parsing import Parser
from r2med_agent.methods.token_cut import cut_words
from r2med_agent.traces import read_traces, trace_from_dict, trace_to_dict, traces_to_jsonl
from r2med_agent.methods.trajectory import AgenticResult, LoopOutcome, Trajectory
from r2med_agent.types import Doc, Generation, Message, Query, SamplingParams, Task

__all__ = [
    "FINAL_MODES",
    "AgenticResult",
    "FinalRanking",
    "LoopLimits",
    "LoopOutcome",
    "SearchO1",
    "SearchR1",
    "read_traces",
    "trace_from_dict",
    "trace_to_dict",
    "traces_to_jsonl",
]

FAMILIES = ("qa", "exam", "treatment", "case")


def _templates_hash(method: str, extra: Sequence[str], prompts_dir: Path | None = None) -> str:
    """One version hash over every template of a method (all families and the extra ones).

    A single loop call batches all tasks, so the key carries the method's whole template set.
    """
    from r2med_agent.prompts.templates import template_hash

    h = hashlib.sha256()
    for name in (*FAMILIES, *extra):
        h.update(f"{name}\0{template_hash(method, name, prompts_dir=prompts_dir)}\0".encode())
    return h.hexdigest()


class SearchR1(ReasoningLoop):
    """Search-R1's evaluation loop (PeterGriffinJin/Search-R1, ``scripts/nq_hotpotqa/evaluate.sh``
    run through ``search_r1/llm_agent/generation.py``), the settings its authors report with;
    ``infer.py`` is a one-question demonstration (sampled at 0.7, 1,024 tokens, no turn limit,
    no cut of the documents).

    Args:
        limits: :attr:`LIMITS` by default: 4 turns in which the model may search (as at
            evaluation), then a final turn; 3 documents inserted per search; documents not cut
            to words first (``max_doc_words`` None, as the original).
        params: :attr:`SAMPLING` by default: greedy (the evaluation's ``do_sample=False``), 500
            tokens per generation step (the evaluation's ``max_response_length``; a step cut
            there without a search or an answer gets the corrective message, as the evaluation
            reads it), seed 42 (matters only with a temperature above 0).
        ranking: ``final`` ``default`` or ``fuse`` (see
            :class:`~r2med_agent.methods.loop.FinalRanking`).
        max_obs_tokens: the inserted ``<information>`` block, tags and blank lines included, is
            cut to this many tokens of the model's tokenizer (500, the evaluation's
            ``max_obs_length``; None: not cut).
    """

    name = "search-r1"
    search_tags = ("<search>", "</search>")
    answer_tags = ("<answer>", "</answer>")
    output_format = "search-r1"
    result_tags = ("<information>", "</information>")
    length_ends = False
    empty_actions = True
    LIMITS: ClassVar[LoopLimits] = LoopLimits(max_turns=4, max_searches=None, docs_per_search=3, final_turn=True)
    SAMPLING: ClassVar[SamplingParams] = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=500, seed=42)

    def __init__(
        self, *, limits: LoopLimits = LIMITS, params: SamplingParams = SAMPLING,
        ranking: FinalRanking = FinalRanking(), max_obs_tokens: int | None = 500,
    ) -> None:
        super().__init__(params=params, limits=limits, ranking=ranking)
        if max_obs_tokens is not None and max_obs_tokens < 1:
            raise ConfigError(f"max_obs_tokens must be at least 1 or None, got {max_obs_tokens}")
        self.max_obs_tokens = max_obs_tokens
        self.needs_tokenizer = max_obs_tokens is not None
        self._hash: str | None = None

    @property
    def template_hash(self) -> str:  # type: ignore[override]
        if self._hash is None:
            self._hash = _templates_hash("search-r1", ("invalid",), self.prompts_dir)
        return self._hash

    def initial_messages(self, task: Task, query: Query) -> list[Message]:
        from r2med_agent.prompts.templates import render

        text = render(f"search-r1/{task.family}.j2", prompts_dir=self.prompts_dir, query=question_mark(query.text),
                      domain=task.domain)
        return [{"role": "user", "content": text}]

    def invalid_turn(self, traj: Trajectory) -> str | None:
        from r2med_agent.prompts.templates import render

        return "\n" + render("search-r1/invalid.j2", prompts_dir=self.prompts_dir).strip() + "\n"

    def insert_documents(self, traj: Trajectory, query: str, docs: Sequence[Doc]) -> str:
        block = f"\n\n{self.result_tags[0]}{format_docs_r1(docs, self.max_doc_words).strip()}{self.result_tags[1]}\n\n"
        # Search-R1 keeps the first max_obs_length tokens of the block (its closing tag too).
        return block if self.max_obs_tokens is None else self.token_cut(block, self.max_obs_tokens)

    def final_response(self, traj: Trajectory, parse: Parser) -> str:
        if traj.answer is not None:
            return traj.answer
        return self.parsed_response(traj, parse)


def question_mark(question: str) -> str:
    """The question as Search-R1 formats it (``infer.py``, ``scripts/data_process/``): stripped,
    with a ``?`` appended when it does not end with one."""
    question = question.strip()
    return question if not question or question.endswith("?") else question + "?"


def doc_title_and_text(doc: Doc) -> tuple[str, str]:
    """A document as Search-R1's retriever returns it: ``(title, text)``.

    The document's own title field when it has one (then the text is all of ``doc.text``), else
    the first line of its text and the rest, as Search-R1 splits its corpus's ``contents``. Never
    the document id: on R2MED's Q&A tasks an id names the question the document was collected
    for, so showing it would leak relevance to the model.
    """
    if doc.title.strip():
        return doc.title.strip(), doc.text
    first, _, rest = doc.text.partition("\n")
    return first.strip(), rest


def format_docs_r1(docs: Sequence[Doc], max_words: int | None) -> str:
    """Search-R1's document block: ``Doc i(Title: <title>) <text>`` per line (see
    :func:`doc_title_and_text`); title and text share the ``max_words`` budget."""
    out = []
    for i, d in enumerate(docs, start=1):
        title, text = doc_title_and_text(d)
        if max_words is not None:
            title = cut_words(title, max_words)
            left = max_words - min(len(title.split()), max_words)
            text = cut_words(text, left) if left > 0 else ("..." if text.strip() else "")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


def format_docs_o1(docs: Sequence[Doc], max_chars: int | None) -> str:
    """The document block Reason-in-Documents reads, built as Search-o1's ``run_search_o1.py``
    builds its web pages: per document a ``**Web Page i:**`` line, then the page's record as
    indented JSON (``id``, ``title``, ``url``, ``site_name``, ``date``, ``snippet``, ``context``).

    A corpus document fills the record as a page without those fields would: ``id`` is its rank
    (never the document id, see :func:`doc_title_and_text`), ``title`` its title field, the web
    fields empty, and ``context`` its first ``max_chars`` characters: with no snippet to locate,
    the original's context is the first ``2 * max_doc_len`` characters of the page (6,000).
    """
    parts = []
    for i, d in enumerate(docs, start=1):
        record = {
            "id": i, "title": d.title.strip(), "url": "", "site_name": "", "date": "", "snippet": "",
            "context": d.text if max_chars is None else d.text[:max_chars],
        }
        parts.append(f"**Web Page {i}:**\n{json.dumps(record, ensure_ascii=False, indent=2)}\n")
    return "".join(parts)


SEARCH_REPEATED = "You have searched this query. Please refer to previous results."
SEARCH_LIMIT = "The maximum search limit is exceeded. You are not allowed to search."
# Search-o1's Reason-in-Documents interface (sunnynexus/Search-o1, scripts/evaluate.py,
# extract_answer with mode "infogen"): the markers the output is split on, each with the newline
# in front of it, and the text inserted when neither is there.
NO_INFORMATION = "No helpful information found."
FINAL_INFORMATION = "\n**Final Information**"
MODIFIED_STEPS = "\n**Modified Reasoning Steps**"
O1_CONTEXT_CHARS = 6000
"""Characters of a document Reason-in-Documents reads: ``run_search_o1.py``'s ``max_doc_len``
(3,000) twice, the context it gives a page whose snippet it cannot locate."""


class SearchO1(ReasoningLoop):
    """Search-o1's loop with Reason-in-Documents (sunnynexus/Search-o1), in the multi-hop QA
    setting of its ``run_search_o1.py`` (the multi-hop instruction, 10 searches, 15 turns; its
    single-QA instruction goes with 5 searches: docs/protocol.md, "Search-o1").

    Args:
        limits: :attr:`LIMITS` by default: 15 turns that may search (a query issued in the last
            of them is run and condensed, and the trajectory stops there), 10 searches a
            trajectory may run (later ones get the limit notice), 10 documents given to
            Reason-in-Documents per search.
        params: :attr:`SAMPLING` by default: temperature 0.7, top_p 0.8, top_k 20, 8,192 tokens
            per generation (the original's value for non-QwQ models), repetition penalty 1.0
            (:meth:`for_model` gives QwQ 20,480 tokens and 1.05, as the original), seed 42.
        ranking: ``final`` ``default`` or ``fuse`` (see
            :class:`~r2med_agent.methods.loop.FinalRanking`).
        max_doc_chars: characters of each document Reason-in-Documents reads (6,000, see
            :data:`O1_CONTEXT_CHARS`; None: whole documents).
        qwq: use the original's QwQ task prompt (without "think step by step").
    """

    name = "search-o1"
    search_tags = ("<|begin_search_query|>", "<|end_search_query|>")
    answer_tags = None
    result_tags = ("<|begin_search_result|>", "<|end_search_result|>")
    condenses = True
    # One user message without the entry's system prompt, and the model's own context length
    # (run_search_o1.py starts vLLM without max_model_len), whatever the entry fixes for others.
    llm_overrides: ClassVar[Mapping[str, Any]] = {"system_prompt": "", "max_model_len": None}
    CONDENSE_REPETITION_PENALTY: ClassVar[float] = 1.05
    QWQ_SAMPLING: ClassVar[Mapping[str, Any]] = {"repetition_penalty": 1.05, "max_tokens": 20480}
    LIMITS: ClassVar[LoopLimits] = LoopLimits(max_turns=15, max_searches=10, docs_per_search=10)
    SAMPLING: ClassVar[SamplingParams] = SamplingParams(
        temperature=0.7, top_p=0.8, top_k=20, max_tokens=8192, seed=42, repetition_penalty=1.0)

    def __init__(
        self, *, limits: LoopLimits = LIMITS, params: SamplingParams = SAMPLING,
        ranking: FinalRanking = FinalRanking(), max_doc_chars: int | None = O1_CONTEXT_CHARS, qwq: bool = False,
    ) -> None:
        self.qwq = qwq
        self.max_doc_chars = max_doc_chars
        super().__init__(params=params, limits=limits, ranking=ranking)
        self._hash: str | None = None

    @property
    def template_hash(self) -> str:  # type: ignore[override]
        if self._hash is None:
            self._hash = _templates_hash("search-o1", ("reason_in_documents",), self.prompts_dir)
        return self._hash

    def initial_messages(self, task: Task, query: Query) -> list[Message]:
        from r2med_agent.prompts.templates import render

        text = render(f"search-o1/{task.family}.j2", prompts_dir=self.prompts_dir, query=query.text,
                      domain=task.domain, max_searches=self.max_searches, qwq=self.qwq)
        return [{"role": "user", "content": text}]

    def for_model(self, model: str) -> SearchO1:
        """This loop as the original runs ``model``: for QwQ, its task prompt and its sampling
        (:attr:`QWQ_SAMPLING`, applied by the runner under any CLI override)."""
        if "qwq" not in model.lower():
            return self
        other = self._copy(qwq=True, model_sampling=dict(self.QWQ_SAMPLING))
        assert isinstance(other, SearchO1)
        return other

    def condense_params(self) -> SamplingParams:
        """Reason-in-Documents samples as the main loop, without its stop strings, and with a
        repetition penalty of 1.05 for every model (as the original)."""
        return dataclasses.replace(
            self.params, stop=(), repetition_penalty=self.CONDENSE_REPETITION_PENALTY
        )

    def _notice(self, text: str) -> str:
        return f"\n{self.result_tags[0]}\n{text}\n{self.result_tags[1]}\n"

    def blocked_search(self, traj: Trajectory, query: str, *, last_turn: bool) -> str | None:
        # The original's order: over the limit first, then repeated. A query of the last turn
        # is run like any other (the original runs and condenses it, then stops).
        if not self.searches_left(traj):
            return self._notice(SEARCH_LIMIT)
        if query in traj.searches:
            return self._notice(SEARCH_REPEATED)
        return None

    def condense_messages(
        self, traj: Trajectory, body: str, query: str, docs: Sequence[Doc]
    ) -> list[Message]:
        from r2med_agent.prompts.templates import render

        # The running text plus this step's body, which ends with the query just issued.
        reasoning = traj.text + body
        text = render(
            "search-o1/reason_in_documents.j2",
            prompts_dir=self.prompts_dir,
            previous_steps=previous_steps(reasoning, self.search_tags[0], self.result_tags[0]),
            search_query=query,
            documents=format_docs_o1(docs, self.max_doc_chars),
        )
        return [{"role": "user", "content": text}]

    def condense_insert(self, gen: Generation) -> tuple[str, str]:
        # The raw output, as the original reads it: the markers are searched in the reasoning too.
        info = extract_final_information(gen.text)
        return info, f"\n\n{self.result_tags[0]}{info}{self.result_tags[1]}\n\n"

    def final_response(self, traj: Trajectory, parse: Parser) -> str:
        return self.parsed_response(traj, parse)


def previous_steps(reasoning: str, query_open: str, result_open: str, keep_last: int = 4) -> str:
    """The "previous reasoning steps" shown to Reason-in-Documents, counted and shortened as
    Search-o1's ``run_search_o1.py`` does.

    Blank lines are first halved (each ``\\n\\n`` becomes one newline), then every line is a
    step, blank ones included: ``Step i: <line>``, the steps separated by blank lines. Counted
    as the original counts them, the text after the last step is one more (empty) part; with
    more than five parts, the first, the last ``keep_last`` parts (so the last ``keep_last - 1``
    steps) and every step holding a search query or result are kept, and each run of dropped
    steps becomes ``...``.
    """
    lines = reasoning.replace("\n\n", "\n").split("\n")
    parts = [f"Step {i}: {line}" for i, line in enumerate(lines, start=1)] + [""]
    if len(parts) <= 5:
        return "\n\n".join(parts).strip("\n")
    out: list[str] = []
    for i, part in enumerate(parts):
        if i == 0 or i >= len(parts) - keep_last or query_open in part or result_open in part:
            out.append(part)
        elif out[-1] != "...":
            out.append("...")
    return "\n\n".join(out).strip("\n")


def extract_final_information(raw: str) -> str:
    """What Reason-in-Documents gives the main loop, as Search-o1 extracts it from the raw output
    (reasoning included): the text after the last ``\\n**Final Information**`` with every
    newline removed; else the text after the last ``\\n**Modified Reasoning Steps**``; else the
    no-information notice. Backticks and whitespace are stripped at both ends."""
    if FINAL_INFORMATION in raw:
        return raw.rpartition(FINAL_INFORMATION)[2].replace("\n", "").strip("`").strip()
    if MODIFIED_STEPS in raw:
        return raw.rpartition(MODIFIED_STEPS)[2].strip("`").strip()
    return NO_INFORMATION
