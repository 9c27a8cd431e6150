"""What a reranker is: its registry entry (:class:`RerankerSpec`, ``configs/rerankers.yaml``) and
the :class:`Reranker` protocol the runner calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal, Protocol, runtime_checkable

from r2med_agent.config import load_registry
from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.spec import Precision, _specifier, weights_dtype_name
from r2med_agent.rerank.kinds import RERANKER_KINDS, RerankerKind, llm_kinds, reranker_kind
from r2med_agent.types import Run, SearchRequest

__all__ = ["Reranker", "RerankerSpec", "follows_published_code", "get_reranker_spec", "reranker_registry"]


@dataclass(frozen=True)
class RerankerSpec:
    """One entry of ``configs/rerankers.yaml``."""

    name: str
    """Registry key; also the reranker's name in result paths."""
    model: str = ""
    """HF id, local folder or ``resource:<package>/<folder>`` of the cross-encoder, or of the LoRA
    adapter when ``base_model`` is set (empty for the LLM kinds)."""
    kind: str = "cross-encoder"
    """A kind of :data:`~r2med_agent.rerank.kinds.RERANKER_KINDS`, which declares what it
    can do. ``cross-encoder``: a scoring model (these fields below ``model``); ``listwise``: an LLM
    orders sliding windows of candidates; ``pointwise-reasoning``: an LLM reasons about each
    (query, document) pair and judges it (see :mod:`r2med_agent.rerank.llm`);
    ``groupwise``: an LLM scores groups of candidates, GroupRank's way
    (:mod:`~r2med_agent.rerank.groupwise`); ``setwise``: an LLM picks the most relevant
    of small sets in a heap sort, Rank-R1's way (:mod:`~r2med_agent.rerank.setwise`)."""
    llm: str = ""
    """The LLM registry name of the LLM kinds."""
    window: int = 20
    """Listwise: candidates the model orders at a time (RankGPT: 20)."""
    step: int = 10
    """Listwise: how far each window moves up the list (RankGPT: 10)."""
    max_doc_words: int = 300
    """LLM kinds: each candidate is cut to its first this many whitespace-separated words."""
    max_doc_chars: int = 0
    """Groupwise: when set, each candidate is cut to this many characters instead (its runs of
    newlines made one space first), as GroupRank cuts them (3000); 0: ``max_doc_words``."""
    max_doc_tokens: int = 0
    """Listwise and setwise: when set, each candidate is cut to this many tokens of the reranker's
    LLM's own tokenizer instead of ``max_doc_words`` (its tokens turned back into text, as
    ReasonRank (512) and Rank-R1 (1024) cut them; see
    :mod:`~r2med_agent.rerank.tokens`); 0: ``max_doc_words``."""
    max_query_tokens: int = 0
    """Setwise: when set, the query is cut the same way to this many tokens (Rank-R1: 1024); 0:
    not cut."""
    fix_text: bool = False
    """ReasonRank's text repair: every candidate and then the whole prompt through ftfy's
    ``fix_text`` (mojibake, HTML entities in a candidate, curly quotes, full-width forms, NFC),
    as ReasonRank's ``convert_doc_to_prompt_content`` and ``create_prompt`` do. Needs ``ftfy``."""
    parse: Literal["strict", "lenient"] = "strict"
    """How answers of a published format are read (``groupwise``, ``setwise``, ``format:
    reasonrank``). ``strict``: exactly as its authors' code reads them (GroupRank: its JSON reading,
    and a group it cannot read scores 0 throughout; Rank-R1: its answer pattern and an exact label,
    else the heap parent stays; ReasonRank: every number of the answer block, and an answer whose
    digits are not numbers leaves the window as it was). ``lenient``: the project's repairs, each
    counted (see each kind's module). Formats without published code read leniently either way."""
    run_scores: Literal["rank", "positional"] = "rank"
    """Listwise: the scores the reranked run is written with. ``rank``: strictly decreasing, so
    the run holds the reranked order exactly; ``positional``: each rank keeps the first-stage score
    that rank had, written to six decimals, as ReasonRank's runs are (its ``receive_permutation``
    keeps the scores in place and its TREC writer prints ``{score:.6f}``); ranks whose scores then
    tie are ordered by evaluation as trec_eval orders ties, as in ReasonRank's own evaluation."""
    unscored: Literal["drop", "zero"] = "drop"
    """Groupwise: a candidate no group's answer scored. ``drop``: left out of the run, as
    GroupRank's script leaves it out of the run it evaluates; ``zero``: kept with score 0."""
    shuffle: Literal["sequential", "per-query"] = "sequential"
    """Groupwise: how candidates are shuffled into groups. ``sequential``: as GroupRank's script,
    one generator seeded ``seed`` per task, drawn pass after pass and query after query in the
    task's order, each pass shuffling the order the pass before left; ``per-query``: a generator
    per pass, task and query (seed ``seed + pass``), so a query's groups do not depend on which
    other queries the run holds."""
    group_size: int = 20
    """Groupwise: candidates the model scores in one answer (GroupRank: 20)."""
    passes: int = 1
    """Groupwise: times the candidates are shuffled into new groups and scored; each document's
    score is the mean over passes (GroupRank's test-time scaling ran 6)."""
    seed: int = 0
    """Groupwise and setwise: seed of the shuffles (pass ``p`` of a groupwise reranker uses
    ``seed + p``); recorded in the traces and stats."""
    num_child: int = 19
    """Setwise: children compared with their parent in one heap step, so sets of ``num_child + 1``
    (Rank-R1: 19, at most 19)."""
    select_k: int = 10
    """Setwise: documents the heap sort brings to the top, in order; the others keep their
    first-stage order below them (Rank-R1: 10)."""
    max_tokens: int = 0
    """LLM kinds: most tokens per answer (0: the LLM entry's ``max_tokens``)."""
    temperature: float = 0.0
    """LLM kinds: sampling temperature of the answers (0: greedy)."""
    top_p: float = 0.0
    """LLM kinds: nucleus sampling of the answers (0: the LLM entry's ``top_p``; GroupRank's
    script samples every model it runs at 0.8)."""
    base_model: str | None = None
    """The model a LoRA adapter applies to (RankLLaMA: ``meta-llama/Llama-2-7b-hf``)."""
    max_length: int = 512
    """Token limit of a (query, document) pair; the longer side is cut first."""
    batch_size: int = 32
    """Pairs per forward pass at ``max_length``; shorter pairs are batched more densely."""
    query_template: str = "{query}"
    """How the query is written into the first segment (RankLLaMA: ``"query: {query}"``)."""
    doc_template: str = "{text}"
    """How the document is written into the second segment (RankLLaMA: ``"document: {text}"``)."""
    score_index: int = 0
    """Which logit is the relevance score (monoBERT's two-way head: 1)."""
    precision: Precision = "auto"
    """As an encoder's ``precision`` (float32 on a CPU; on a GPU ``float32``, ``float16``,
    ``bfloat16``, ``autocast-float16`` or ``auto``). The paper's rerankers set the precision
    R2MED's reference ran them at (bge and monoBERT float32, RankLLaMA float16)."""
    backend: Literal["auto", "transformers", "vllm"] = "auto"
    """``auto``: vLLM when it is installed, a GPU is present and the head has one logit
    (``score_index`` 0), else transformers."""
    trust_remote_code: bool = False
    """Allow the model repo's own modelling code."""
    transformers: str = ""
    """Version specifier the installed transformers must satisfy (as for encoders); empty: any."""
    format: str = "default"
    """LLM kinds: the input and answer format. ``default``: the project's prompts;
    ``reasonrank`` (listwise): ReasonRank's trained format, reasoning in ``<think>``, the order in
    ``<answer>``; ``insertrank`` (listwise): each candidate shown with its first-stage score;
    ``rank1`` (pointwise-reasoning): Rank1's raw-text format, scored by P(true) of the judgment
    token (see :mod:`r2med_agent.rerank.llm`)."""

    @property
    def dtype(self) -> str:
        """The weights' dtype name ``precision`` implies (``autocast-float16``: float32)."""
        return weights_dtype_name(self.precision)

    def __post_init__(self) -> None:
        kind = reranker_kind(self.kind)
        _check_llm_fields(self, kind) if kind.uses_llm else _check_no_llm(self)
        if kind.has_model:
            _check_model_fields(self)
        elif self.model and not kind.uses_llm:
            raise ValueError(f"kind {self.kind} loads no model; leave out 'model'")
        if self.format not in kind.formats:
            takers = [n for n, k in RERANKER_KINDS.items() if self.format in k.formats]
            raise ValueError(f"format {self.format} is for kind {' or '.join(takers) or 'none'}"
                             if takers else f"format must be one of {', '.join(kind.formats)} for kind {self.kind}")
        for name in {f for k in RERANKER_KINDS.values() for f in k.fields} - set(kind.fields):
            if getattr(self, name) != _DEFAULTS[name]:
                owners = [n for n, k in RERANKER_KINDS.items() if name in k.fields]
                raise ValueError(f"{name} is for kind {' or '.join(owners)}")

    @property
    def kind_of(self) -> RerankerKind:
        """The declaration of this entry's kind (:data:`~r2med_agent.rerank.kinds.RERANKER_KINDS`)."""
        return reranker_kind(self.kind)

    @property
    def prompt_folder(self) -> str | None:
        """The prompt folder this entry renders (None: a kind without prompts)."""
        return self.kind_of.folder(self.format)


def _check_llm_fields(spec: RerankerSpec, kind: RerankerKind) -> None:
    """The fields of a kind an LLM answers."""
    if not spec.llm or spec.model:
        raise ValueError(f"kind {spec.kind} needs 'llm' (an LLM registry name) and no 'model'")
    if spec.window < 2 or spec.step < 1 or spec.step >= spec.window:
        raise ValueError("window must be >= 2 and step between 1 and window - 1")
    if spec.max_doc_words < 1 or spec.max_tokens < 0 or spec.temperature < 0:
        raise ValueError("max_doc_words must be >= 1, max_tokens >= 0, temperature >= 0")
    if not 0.0 <= spec.top_p <= 1.0 or spec.max_doc_tokens < 0 or spec.max_query_tokens < 0:
        raise ValueError("top_p must be between 0 and 1 (0: the LLM entry's), max_doc_tokens and "
                         "max_query_tokens >= 0")
    if spec.group_size < 1 or spec.passes < 1 or spec.max_doc_chars < 0:
        raise ValueError("group_size and passes must be >= 1, max_doc_chars >= 0")
    if not 1 <= spec.num_child <= 19 or spec.select_k < 1:
        raise ValueError("num_child must be between 1 and 19 (sets of at most 20), select_k >= 1")


def _check_no_llm(spec: RerankerSpec) -> None:
    """A kind no LLM answers takes none of the LLM kinds' fields."""
    if spec.llm or spec.format != "default":
        raise ValueError(f"'llm' and 'format' are for the LLM kinds ({', '.join(llm_kinds())})")
    if spec.max_doc_tokens or spec.max_query_tokens or spec.fix_text or spec.top_p:
        raise ValueError("max_doc_tokens, max_query_tokens, fix_text and top_p are for the LLM kinds")


def _check_model_fields(spec: RerankerSpec) -> None:
    """The fields of a kind that loads a model of its own."""
    if not spec.model:
        raise ValueError(f"a {spec.kind} needs 'model'")
    if "{query}" not in spec.query_template or "{text}" not in spec.doc_template:
        raise ValueError("query_template needs '{query}' and doc_template needs '{text}'")
    if spec.max_length < 8 or spec.batch_size < 1 or spec.score_index < 0:
        raise ValueError("max_length must be >= 8, batch_size >= 1, score_index >= 0")
    if spec.transformers:
        _specifier(spec.transformers)


_DEFAULTS = {f.name: f.default for f in fields(RerankerSpec)}


def follows_published_code(spec: RerankerSpec) -> bool:
    """Whether an entry runs a published LLM reranker's code (its kind's ``published_formats``:
    the ``groupwise`` and ``setwise`` kinds, GroupRank's and Rank-R1's; the ``reasonrank`` and
    ``rank1`` formats): the entries whose results the run spec's ``rerank_rules`` versions."""
    return spec.format in spec.kind_of.published_formats


def reranker_registry() -> dict[str, RerankerSpec]:
    return load_registry("rerankers", RerankerSpec)


def get_reranker_spec(name: str) -> RerankerSpec:
    reg = reranker_registry()
    if name not in reg:
        from r2med_agent.errors import did_you_mean

        raise ConfigError(
            f"unknown reranker '{name}'{did_you_mean(name, reg)}; known: {', '.join(sorted(reg))} "
            "(`r2med-agent rerankers` lists them; add your own under 'rerankers:' in a user config file)"
        )
    return reg[name]


@runtime_checkable
class Reranker(Protocol):
    """Re-scores the top ``k`` of each query's list; the rest stays below in its original order.

    ``batches_tasks`` False: the runner calls :meth:`rerank` per task. True (LLM rerankers): it
    calls ``rerank_tasks(jobs, k)`` once with every task, so one generate call serves them all.
    """

    name: str
    batches_tasks: bool

    def check(self) -> None:
        """Raise now if the model cannot be loaded (cheap: no weights, no GPU memory)."""
        ...

    def rerank(
        self, requests: Sequence[SearchRequest], run: Run, corpus: Mapping[str, str], k: int
    ) -> Run: ...
