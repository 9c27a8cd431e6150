"""Groupwise reranking as GroupRank (``kind: groupwise``): the model reads the query and a group
of candidates and gives each one a score from 0 to 10; the scores of all groups give the order.

The input keeps GroupRank's trained format exactly (``prompts/rerank-groupwise/``; source:
AQ-MedAI/Diver, ``Reranker/rerank_groupwise.py``): a system and a user message, the documents
numbered ``[1]. text`` each followed by a blank line, and the answer it asks for, a ``<reason>``
part and then ``<answer>`` holding a fenced JSON object ``{"[1]": 5, ...}``. The instruction
around that format is the project's own wording; the authors' exact text, which GroupRank-32B was
trained on, comes from a user's clone through ``r2med-agent prompts import``. Every task family
reads the same prompt. A Qwen3
model's ``<think>`` (``enable_thinking`` in its LLM entry's ``chat_template_kwargs``) comes before
all that and is split off by the LLM's reasoning parser.

One pass shuffles a query's top ``k`` and cuts them into groups of ``group_size`` (GroupRank:
20); ``passes: N`` repeats that (GroupRank's test-time scaling, ``repeat_num``) and a document's
score is the mean of the scores the answers gave it, each divided by 10. The shuffles
(``shuffle``) are by default GroupRank's own: one generator seeded ``seed`` per task (its script's
``random.seed(666)``, one process per task), drawn pass after pass and, in each pass, query after
query in the order the first-stage run lists them (GroupRank goes through its score file's keys;
a run file's order with ``--candidates``, else the task's), each pass reshuffling the order the
last one left; so, given the same first-stage run, the groups are the ones its script builds.
``per-query`` gives each pass of each query a generator of its own instead. Documents are cut to
``max_doc_chars`` characters after their runs of newlines become one space, as GroupRank does
(3000), or else to ``max_doc_words`` words.

Reading the answers (``parse``) is by default GroupRank's own (:func:`grouprank_pairs`): the raw
answer's ``<answer>`` part, its last fenced JSON block or last ``{...}``, GroupRank's small fixes,
``json.loads``; each key mapped to a document of the group as its script maps it. Where that
fails at any point, the whole group scores 0, as in GroupRank (counted as ``unparseable``). A
document that no answer scored is left out of the run, as GroupRank's run leaves it out
(``unscored: drop``; ``zero`` keeps it at 0). Scores that tie stay tied in the run, as in
GroupRank's, so evaluation orders them as trec_eval does (by document id); the trace lists them in
the order GroupRank's sort leaves them. ``parse: lenient`` reads the final response with repairs
instead (:func:`parse_group_scores`): an answer with no score at all (``unparseable``: the group
scores 0), documents it leaves out (``missing``), numbers that are no document of the group
(``out_of_range``, ignored), numbers named twice (``repeated``, the last one counts) and scores
outside 0-10 (``clamped``), each counted. GroupRank's script also reports a 0.6/0.4 interpolation
with the retriever's scores; that is not done here (docs/protocol.md).

Batching: every group of one pass, of every query of every task, goes in ONE ``generate`` call
(``passes`` calls in all), through the generation cache. Pass ``p`` is sample ``p`` of its prompts:
a group that recurs in another pass (a list not longer than a few documents can be shuffled into
the same order twice) gets an answer of its own, as GroupRank's script samples it again.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from r2med_agent.prompts import templates as prompts
from r2med_agent.errors import ConfigError
from r2med_agent.rerank.answers import cut_words
from r2med_agent.rerank.llm import LLMReranker
from r2med_agent.rerank.llm_jobs import (
    RerankJob,
    RerankOutput,
    RerankQuery,
    generation_stats,
    ranked_requests,
)
from r2med_agent.types import Generation, Message, Task, TraceStep

logger = logging.getLogger(__name__)

FAMILIES = ("qa", "exam", "treatment", "case")

SCORE_MAX = 10.0
"""The top of GroupRank's scale; scores are divided by it."""

_FENCED_RE = re.compile(r"```json\s*([\s\S]+?)\s*```")
# A key "[3]" (or "3", [3], 3) and its number; GroupRank reads the key with int(k.strip('[]')).
_PAIR_RE = re.compile(r'"?\s*\[?\s*(\d+)\s*\]*\s*"?\s*:\s*(-?\d+(?:\.\d+)?)')
_NEWLINES_RE = re.compile(r"\n+")
_DOUBLED_BRACKET_RE = re.compile(r"(\[\d+\])\]")
_SPACES_RE = re.compile(r"\s+")


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class GroupRepair:
    """What :func:`parse_group_scores` had to fix in one answer."""

    unparseable: int = 0
    """1 when the answer gave no score at all."""
    missing: int = 0
    """Documents of the group the answer gave no score."""
    repeated: int = 0
    """Numbers scored again (the last score counts)."""
    out_of_range: int = 0
    """Numbers that are no document of the group (ignored)."""
    clamped: int = 0
    """Scores outside 0-10, moved to the nearer end."""

    @property
    def any(self) -> bool:
        return any(self.to_dict().values())

    def to_dict(self) -> dict[str, int]:
        return {"unparseable": self.unparseable, "missing": self.missing, "repeated": self.repeated,
                "out_of_range": self.out_of_range, "clamped": self.clamped}


REPAIR_KINDS = tuple(GroupRepair().to_dict())


def _last_braces(text: str) -> str | None:
    """The last ``{...}`` of ``text`` as ``re.findall(r"\\{[\\s\\S]*?\\}", text)[-1]`` finds it
    (None: none), in one pass: each match runs from the first ``{`` after the previous one to the
    first ``}`` after it. The regular expression tries every ``{`` against the rest of the text,
    quadratic on an answer of unclosed braces."""
    last, pos = None, 0
    while (start := text.find("{", pos)) >= 0 and (end := text.find("}", start)) >= 0:
        last, pos = text[start:end + 1], end + 1
    return last


def _inside_answer(text: str) -> str:
    """What ``<answer>(.*?)</answer>`` (dot matching newlines) finds, stripped; ``text`` when it
    finds nothing. One pass: when the first ``<answer>`` has no ``</answer>`` after it, no later
    one has (the pattern tried each against the rest of the text)."""
    start = text.find("<answer>")
    end = text.find("</answer>", start + len("<answer>")) if start >= 0 else -1
    return text[start + len("<answer>"):end].strip() if end >= 0 else text


def answer_block(text: str) -> str:
    """The part of an answer holding the scores: inside ``<answer>`` when there is one, the last
    fenced JSON block, else the last ``{...}``, else from the last ``{`` to the end; every run of
    whitespace in it made one space (the patterns read a run and a space alike, and a long run made
    them backtrack: 1,000 trailing spaces took seconds, 2,000 most of a minute)."""
    text = _inside_answer(_SPACES_RE.sub(" ", text))
    fenced = _FENCED_RE.findall(text)
    if fenced:
        return fenced[-1].strip()
    braces = _last_braces(text)
    if braces is not None:
        return braces
    start = text.rfind("{")
    return text[start:] if start >= 0 else ""


def parse_group_scores(text: str, size: int) -> tuple[list[float | None], GroupRepair]:
    """The score (0-1) of each of a group's ``size`` documents in an answer, None where it has
    none, and what was repaired. An answer without any score scores every document 0."""
    scores: list[float | None] = [None] * size
    repeated = out_of_range = clamped = 0
    pairs = _PAIR_RE.findall(answer_block(text))
    for key, value in pairs:
        i = int(key) - 1
        if not 0 <= i < size:
            out_of_range += 1
            continue
        if scores[i] is not None:
            repeated += 1
        v = float(value)
        if not 0.0 <= v <= SCORE_MAX:
            clamped += 1
            v = min(max(v, 0.0), SCORE_MAX)
        scores[i] = v / SCORE_MAX
    if all(s is None for s in scores):
        return [0.0] * size, GroupRepair(unparseable=1, out_of_range=out_of_range)
    missing = sum(1 for s in scores if s is None)
    return scores, GroupRepair(0, missing, repeated, out_of_range, clamped)


def grouprank_answer(text: str) -> dict[Any, Any] | None:
    """The object GroupRank's ``_extract_rerank_output`` reads from an answer, or None where it
    fails: inside ``<answer>`` when there is one, the last fenced JSON block (else the last
    ``{...}``; none: a failure), a doubled bracket after a key number removed (``"[7]]"``), one
    ``}`` added when a ``{`` is unclosed, whitespace runs made one space, then ``json.loads`` and
    ``dict``. A ``NaN`` or ``Infinity`` also fails here, where GroupRank would average it in."""
    text = _inside_answer(_SPACES_RE.sub(" ", text))  # whitespace as made below anyway (answer_block)
    fenced = _FENCED_RE.findall(text)
    if fenced:
        block = fenced[-1].strip()
    else:
        block = _last_braces(text)
        if block is None:
            return None
    block = _DOUBLED_BRACKET_RE.sub(r"\1", block.strip())
    if block.count("{") > block.count("}"):
        block += "}"
    block = _SPACES_RE.sub(" ", block).strip()
    try:
        return dict(json.loads(block, parse_constant=_no_constant))
    except Exception:  # noqa: BLE001 - every failure of GroupRank's own reading zeroes the group
        return None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is no score")


def grouprank_pairs(text: str, doc_ids: Sequence[str]) -> list[tuple[str, float]] | None:
    """``(doc id, score / 10)`` for each key of the answer's object in its order, as GroupRank maps
    them (``dids[int(key.strip().strip('[]')) - 1]``: so ``"[0]"`` names the group's last document,
    as Python's indexing does there); None when its reading fails or any key or score does not
    map (a key past the group, a score that is no number), which zeroes the whole group."""
    obj = grouprank_answer(text)
    if obj is None:
        return None
    out: list[tuple[str, float]] = []
    try:
        for key, score in obj.items():
            out.append((doc_ids[int(key.strip().strip("[]")) - 1], score / SCORE_MAX))
    except Exception:  # noqa: BLE001 - as GroupRank's try around the mapping
        return None
    return out


def read_group(gen: Generation, group: Sequence[str], *, strict: bool) -> tuple[
        list[tuple[str, float]], list[float | None], GroupRepair]:
    """One group's answer read: the ``(doc id, score)`` pairs that join the documents' means, the
    score shown per group position (None: none), and what was repaired. ``strict`` reads the raw
    text as GroupRank does (:func:`grouprank_pairs`; a failure scores the group 0 throughout);
    otherwise the final response, with the repairs of :func:`parse_group_scores`."""
    if not strict:
        scores, repair = parse_group_scores(gen.final, len(group))
        return [(d, s) for d, s in zip(group, scores) if s is not None], scores, repair
    pairs = grouprank_pairs(gen.text, group)
    if pairs is None:
        return [(d, 0.0) for d in group], [0.0] * len(group), GroupRepair(unparseable=1)
    last = dict(pairs)
    shown = [last.get(d) for d in group]
    return pairs, shown, GroupRepair(missing=sum(1 for s in shown if s is None))


def final_order(head: Sequence[str], got: Mapping[str, list[float]], unscored: str, *,
                strict: bool) -> tuple[list[str], list[float], list[str]]:
    """A query's documents by their mean score, the scores, and the documents no answer scored.

    Ties keep their scores tied (GroupRank writes its run so; evaluation then orders them as
    trec_eval does, by document id). Listed in the order GroupRank's sort leaves them (``strict``:
    the order in which the answers first scored them; else first-stage order). An unscored
    document is left out (``drop``, GroupRank) or scores 0 (``zero``)."""
    means = {d: sum(v) / len(v) for d, v in got.items() if v}
    base = [d for d in got if d in means] if strict else [d for d in head if d in means]
    missing = [d for d in head if d not in means]
    entries = [(d, means[d]) for d in base] + ([(d, 0.0) for d in missing] if unscored == "zero" else [])
    entries.sort(key=lambda e: -e[1])  # stable
    return [d for d, _ in entries], [s for _, s in entries], missing


def make_groups(doc_ids: Sequence[str], group_size: int, rng: random.Random) -> list[list[str]]:
    """``doc_ids`` shuffled by ``rng`` and cut into groups of ``group_size`` (the last may be
    smaller)."""
    order = list(doc_ids)
    rng.shuffle(order)
    return [order[i:i + group_size] for i in range(0, len(order), group_size)]


def pass_rng(seed: int, task: str, query_id: str) -> random.Random:
    """The shuffle of one pass (``seed``) of one query: the same on every machine and run."""
    return random.Random(f"{seed}/{task}/{query_id}")


def grouprank_text(text: str, max_chars: int) -> str:
    """A document as GroupRank shows it: runs of newlines made one space, cut to ``max_chars``."""
    return _NEWLINES_RE.sub(" ", text)[:max_chars]


# --------------------------------------------------------------------------- shared reranker parts


class JobReranker(LLMReranker):
    """The setup of :class:`~r2med_agent.rerank.llm.LLMReranker` (its LLM built on first
    use, shared with the run, its sampling) for kinds with their own prompt folder and loop;
    subclasses set ``KIND`` and ``PROMPT_FOLDER`` and write :meth:`_rerank` and :meth:`_stats`."""

    KIND = ""
    PROMPT_FOLDER = ""
    RECORDS = "records"
    """The key of the per-query records in each trace's ``extra``."""

    def __init__(self, spec: Any, *, llm: Any = None, cache_path: Any = None, use_cache: bool = True,
                 refresh: bool = False, chunk_size: Any = "auto", prompts_dir: Any = None) -> None:
        if spec.kind != self.KIND:
            raise ConfigError(f"reranker '{spec.name}' is not a {self.KIND} reranker (kind {spec.kind})")
        self.spec = spec
        self.name = spec.name
        self.kind = spec.kind
        self.format = getattr(spec, "format", "default")
        self._llm = llm
        self._llm_opts = dict(cache_path=cache_path, use_cache=use_cache, refresh=refresh, chunk_size=chunk_size)
        self.prompts_dir = prompts_dir
        self._cut = None

    def check(self) -> None:
        """Fail now (ConfigError) on an unknown LLM or a missing prompt; loads nothing."""
        self.llm_spec()
        for family in FAMILIES:
            prompts.template_hash(self.PROMPT_FOLDER, family, prompts_dir=self.prompts_dir)

    def messages(self, task: Task, query: str, passages: Sequence[str]) -> list[Message]:
        """The system and user messages for ``passages`` (already cut) of one query."""
        path = f"{self.PROMPT_FOLDER}/{task.family}.j2"
        return [{"role": part, "content": prompts.render(path, prompts_dir=self.prompts_dir, part=part, query=query,
                                                          passages=list(passages), domain=task.domain)}
                for part in ("system", "user")]

    def template_hash(self, task: Task) -> str:
        return prompts.template_hash(self.PROMPT_FOLDER, task.family, prompts_dir=self.prompts_dir)

    def meta(self, q: RerankQuery, **extra: Any) -> dict[str, Any]:
        return {"task": q.task.name, "query_id": q.request.query_id, "method": f"rerank-{self.kind}",
                "reranker": self.name, **extra}

    def rerank_tasks(self, jobs: Sequence[RerankJob], k: int) -> list[RerankOutput]:
        """Rerank the top ``k`` of every query of every job, batched over all of them."""
        positions = [{qid: i for i, qid in enumerate(job.run)} for job in jobs]
        queries = [RerankQuery(j, job.task, req, items[:k], items[k:], job.corpus,
                               run_position=positions[j].get(req.query_id, len(positions[j])))
                   for j, job, req, items in ranked_requests(jobs, k)]
        self._rerank(queries)
        return self._outputs(jobs, queries)

    def _rerank(self, queries: list[RerankQuery]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _stats(self, queries: list[RerankQuery]) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _outputs(self, jobs: Sequence[RerankJob], queries: list[RerankQuery]) -> list[RerankOutput]:
        outputs = [RerankOutput({}, []) for _ in jobs]
        for q in queries:
            out = outputs[q.job]
            out.run[q.request.query_id] = q.reranked_run()
            extra = {"task": q.task.name, "query": q.request.query, "reranker": self.name, "kind": self.kind,
                     "seed": self.spec.seed, self.RECORDS: q.records, **({"unscored": q.unscored} if q.unscored else {})}
            out.traces.append(q.trace(f"rerank-{self.kind}", extra))
        for j, out in enumerate(outputs):
            mine = [q for q in queries if q.job == j]
            out.stats = {
                "reranker": self.name, "kind": self.kind, "llm": self.spec.llm,
                **generation_stats([g for q in mine for g in q.gens]),
                "seed": self.spec.seed,
                **self.cut_stats(),
                **self._stats(mine),
            }
        return outputs


# --------------------------------------------------------------------------- groupwise


class GroupwiseReranker(JobReranker):
    """GroupRank's groupwise reranker over an LLM of the registry (see the module docstring).

    Args: as :class:`~r2med_agent.rerank.llm.LLMReranker`.
    """

    KIND = "groupwise"
    PROMPT_FOLDER = "rerank-groupwise"
    RECORDS = "groups"

    def _doc_text(self, q: RerankQuery, doc_id: str) -> str:
        text = q.corpus[doc_id]
        if self.spec.max_doc_chars:
            return grouprank_text(text, self.spec.max_doc_chars)
        return cut_words(text, self.spec.max_doc_words)

    def _groups(self, queries: list[RerankQuery]) -> list[tuple[RerankQuery, int, int, list[str]]]:
        """Every group of every pass, pass after pass, each pass query after query (GroupRank's
        batch order: a task's queries in the order its first-stage run lists them, as GroupRank
        goes through its score file's keys): ``(query, pass, group index, doc ids)``."""
        spec = self.spec
        batch: list[tuple[RerankQuery, int, int, list[str]]] = []
        if spec.shuffle == "sequential":  # one generator per task, as GroupRank's random.seed per run
            rngs = {job: random.Random(spec.seed) for job in {q.job for q in queries}}
            orders = {id(q): list(q.head) for q in queries}
            in_run_order = sorted(queries, key=lambda q: (q.job, q.run_position))
            for p in range(spec.passes):
                for q in in_run_order:
                    rngs[q.job].shuffle(orders[id(q)])  # in place: each pass reshuffles the last one's order
                    order = orders[id(q)]
                    for g, i in enumerate(range(0, len(order), spec.group_size)):
                        batch.append((q, p, g, order[i:i + spec.group_size]))
            return batch
        for p in range(spec.passes):
            for q in queries:
                rng = pass_rng(spec.seed + p, q.task.name, q.request.query_id)
                for g, group in enumerate(make_groups(q.head, spec.group_size, rng)):
                    batch.append((q, p, g, group))
        return batch

    def _generate(self, batch: list[tuple[RerankQuery, int, int, list[str]]]) -> list[Generation]:
        """The answers to every group: one generate call per pass, holding that pass's groups of
        every query of every task. Pass ``p`` is sample ``p`` of its prompts (its own cache key and
        seed), so a group that recurs in another pass is answered anew, as GroupRank samples it
        again."""
        params = self.sampling()
        outs: list[Generation] = []
        for p in range(self.spec.passes):
            part = [b for b in batch if b[1] == p]
            if not part:
                continue
            logger.info("%s: pass %d of %d, %d groups in one batch", self.name, p + 1, self.spec.passes, len(part))
            seeded = params if p == 0 or params.seed is None else replace(params, seed=params.seed + p)
            outs += self.llm.generate(
                [self.messages(q.task, q.request.query, [self._doc_text(q, d) for d in group]) for q, _, _, group in part],
                seeded, sample_index=p, template_hash=[self.template_hash(q.task) for q, *_ in part],
                meta=[self.meta(q, **{"pass": p, "group": g}) for q, _, g, _ in part])
        return outs

    def _rerank(self, queries: list[RerankQuery]) -> None:
        spec = self.spec
        batch = self._groups(queries)
        outs = self._generate(batch)
        got: dict[int, dict[str, list[float]]] = {id(q): {} for q in queries}
        for (q, p, g, group), gen in zip(batch, outs):
            q.gens.append(gen)
            pairs, scores, repair = read_group(gen, group, strict=spec.parse == "strict")
            for d, s in pairs:
                got[id(q)].setdefault(d, []).append(s)
            seed = spec.seed if spec.shuffle == "sequential" else spec.seed + p
            q.records.append({"pass": p, "seed": seed, "group": g, "doc_ids": group,
                              "scores": scores, **repair.to_dict(), "finish_reason": gen.finish_reason})
            note = ", ".join(f"[{i}] {'-' if s is None else round(s * SCORE_MAX, 2)}" for i, s in enumerate(scores, 1))
            if repair.any:
                note += " (repaired: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in repair.to_dict().items() if n) + ")"
            q.steps.append(TraceStep(generated=gen.text, search_query=f"pass {p + 1}, group {g + 1}", doc_ids=tuple(group),
                                     inserted=note, prompt_tokens=gen.prompt_tokens,
                                     completion_tokens=gen.completion_tokens))
        for q in queries:
            q.head, q.scores, q.unscored = final_order(q.head, got[id(q)], spec.unscored, strict=spec.parse == "strict")

    def _stats(self, queries: list[RerankQuery]) -> dict[str, Any]:
        groups = [r for q in queries for r in q.records]
        return {"passes": self.spec.passes, "group_size": self.spec.group_size, "groups": len(groups),
                "parse": self.spec.parse, "shuffle": self.spec.shuffle,
                "repairs": {k: sum(r[k] for r in groups) for k in REPAIR_KINDS},
                "answers_repaired": sum(1 for r in groups if any(r[k] for k in REPAIR_KINDS)),
                "unscored": sum(len(q.unscored) for q in queries), "unscored_policy": self.spec.unscored}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
