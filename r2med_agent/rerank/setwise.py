"""Setwise reranking as Rank-R1 (``kind: setwise``): the model reasons in ``<think>`` and answers
which document of a small set is the most relevant, ``<answer>[3]</answer>``; a heap sort built on
those choices brings the best ``select_k`` documents to the top.

The input is Rank-R1's, verbatim (``prompts/rerank-setwise/``; source: ielab/llm-rankers, the
BRIGHT evaluation of ``Rank-R1/README.md``, which runs ``Rank-R1/run_setwise.py`` with
``prompts/prompt_setwise-R1.toml``): its system prompt, and its user prompt with the documents
written ``[i]: text`` (the file's ``doc_prefix``), one per line (``doc_separator``). As there, the
documents of each set are shown in a shuffled order, and the answer is read with Rank-R1's pattern
``<think>.*?</think>\\s*<answer>(.*?)</answer>`` over the lower-cased raw answer; what it
captures must be one of the set's labels exactly, else the heap parent stays (the set's first
document), as Rank-R1 does (``parse: strict``; ``lenient`` also reads the final response's
``<answer>`` where the pattern fails, and any bracketed number of the set; counts per way of
reading: ``answer_tag``, ``unanswered``). Rank-R1 shuffles every set with one generator shared by
all queries in turn, so a query's shuffles depend on how many comparisons the queries before it
took; here each query has its own seeded generator, which lets all queries advance together (a
kept difference, docs/protocol.md).

The selection is llm-rankers' ``heapsort`` (:func:`heapsort_selection`), the method Rank-R1 was
evaluated with (``--method heapsort --num_child 19 --k 10``: sets of 20, the top 10 sorted, the
other documents below them in their first-stage order); its bubble sort is not offered. A heap
sort is a chain of choices per query, so queries advance together: each round sends the next
comparison of every query still sorting, over all tasks, in ONE ``generate`` call, through the
generation cache. The query and the documents are cut to ``max_query_tokens`` and
``max_doc_tokens`` tokens of the model's tokenizer, as Rank-R1's script cuts them (1024 each on
BRIGHT; :mod:`~r2med_agent.rerank.tokens`), or, without ``max_doc_tokens``, the
documents to ``max_doc_words`` words.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Generator
from typing import Any

from r2med_agent.rerank.groupwise import JobReranker
from r2med_agent.rerank.llm_jobs import RerankQuery
from r2med_agent.types import TraceStep

logger = logging.getLogger(__name__)

# Rank-R1's answer pattern, verbatim: `pattern` of Rank-R1/prompts/prompt_setwise-R1.toml
# (ielab/llm-rankers), matched against the lower-cased completion.
RANK_R1_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LABEL_RE = re.compile(r"\[(\d+)\]")

Comparisons = Generator[list[int], int, list[int]]


# --------------------------------------------------------------------------- pure parts


def _heapify(arr: list[int], size: int, i: int, num_child: int) -> Generator[list[int], int, None]:
    """Sift ``arr[i]`` down a heap of ``size`` in which each node has ``num_child`` children,
    asking (yield) which of a parent and its children is the most relevant (an index into the
    yielded set; one out of range keeps the parent)."""
    while num_child * i + 1 < size:
        inds = [i, *range(num_child * i + 1, min(num_child * (i + 1) + 1, size))]
        best = yield [arr[j] for j in inds]
        largest = inds[best] if 0 <= best < len(inds) else i
        if largest == i:
            return
        arr[i], arr[largest] = arr[largest], arr[i]
        i = largest


def heapsort_selection(n: int, num_child: int, k: int) -> Comparisons:
    """llm-rankers' setwise heap sort over positions ``0..n-1``, as a generator: it yields each set
    to compare (positions, the parent first), is sent the index of the set's most relevant
    member, and returns the new order: the ``k`` best in order, then the rest in their order.

    A max-heap is built bottom-up from node ``n // num_child``, then the root is swapped to the
    end and the heap re-sifted until ``k`` documents are placed.
    """
    arr = list(range(n))
    for i in range(n // num_child, -1, -1):
        yield from _heapify(arr, n, i, num_child)
    placed = 0
    for i in range(n - 1, 0, -1):
        arr[i], arr[0] = arr[0], arr[i]
        placed += 1
        if placed == k:
            break
        yield from _heapify(arr, i, 0, num_child)
    top = list(reversed(arr))[:k]
    chosen = set(top)
    return top + [j for j in range(n) if j not in chosen]


def parse_choice(text: str, final: str, size: int, *, strict: bool = True) -> tuple[int, str]:
    """The set member (0-based, in the order shown) an answer names, and how it was read:
    ``pattern`` (Rank-R1's), ``answer_tag`` (only the final response's ``<answer>``) or
    ``unanswered`` (0: the first one shown).

    ``strict`` reads as Rank-R1's ``compare`` does: its pattern over the lower-cased raw answer,
    and what it captures, stripped, must be one of the set's labels exactly (``[1]`` ... ``[n]``).
    Otherwise the final response's ``<answer>`` is read too where the pattern fails, and a label
    is any bracketed number of the set (``[03]`` too)."""
    m = RANK_R1_PATTERN.search(text.lower())
    how = "pattern"
    if m is None and not strict:
        m = _ANSWER_TAG_RE.search(final.lower())
        how = "answer_tag"
    if m is None:
        return 0, "unanswered"
    answer = m.group(1).strip()
    if strict:
        labels = [f"[{i + 1}]" for i in range(size)]
        return (labels.index(answer), how) if answer in labels else (0, "unanswered")
    label = _LABEL_RE.fullmatch(answer)
    if label is None or not 1 <= int(label.group(1)) <= size:
        return 0, "unanswered"
    return int(label.group(1)) - 1, how


HOW = ("pattern", "answer_tag", "unanswered")


# --------------------------------------------------------------------------- reranker


class SetwiseReranker(JobReranker):
    """Rank-R1's setwise reranker over an LLM of the registry (see the module docstring).

    Args: as :class:`~r2med_agent.rerank.llm.LLMReranker`.
    """

    KIND = "setwise"
    PROMPT_FOLDER = "rerank-setwise"
    RECORDS = "comparisons"

    def _rerank(self, queries: list[RerankQuery]) -> None:
        spec = self.spec
        sorts: dict[int, Comparisons] = {}
        pending: dict[int, list[int]] = {}
        rngs: dict[int, random.Random] = {}
        for n, q in enumerate(queries):
            sorts[n] = heapsort_selection(len(q.head), spec.num_child, spec.select_k)
            rngs[n] = random.Random(f"{spec.seed}/{q.task.name}/{q.request.query_id}")
            self._advance(n, q, sorts, pending, None)
        params = self.sampling()
        strict = spec.parse == "strict"
        rounds = 0
        while pending:
            rounds += 1
            batch = sorted(pending)
            shown = {n: _shuffled(pending[n], rngs[n]) for n in batch}
            prompts_ = [self.messages(queries[n].task, self._query_text(queries[n]),
                                      [self._doc_text(queries[n], queries[n].head[i]) for i in shown[n]])
                        for n in batch]
            logger.info("%s: comparison round %d, %d queries in one batch", self.name, rounds, len(batch))
            outs = self.llm.generate(prompts_, params, template_hash=[self.template_hash(queries[n].task) for n in batch],
                                     meta=[self.meta(queries[n], round=rounds) for n in batch])
            for n, gen in zip(batch, outs):
                q, order = queries[n], shown[n]
                pick, how = parse_choice(gen.text, gen.final, len(order), strict=strict)
                # No usable answer: the heap parent (the set's first member) stays, as in Rank-R1.
                best = 0 if how == "unanswered" else pending[n].index(order[pick])
                q.gens.append(gen)
                docs = [q.head[i] for i in order]
                chosen = q.head[pending[n][best]]
                q.records.append({"round": rounds, "doc_ids": docs, "choice": None if how == "unanswered" else pick + 1,
                                  "chosen": chosen, "read": how, "finish_reason": gen.finish_reason})
                label = "none, the parent stays" if how == "unanswered" else f"[{pick + 1}] ({how})"
                q.steps.append(TraceStep(generated=gen.text, search_query=f"comparison {len(q.records)}",
                                         doc_ids=tuple(docs), inserted=f"most relevant: {label}: {chosen}",
                                         prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens))
                self._advance(n, q, sorts, pending, best)
        for q in queries:
            q.scores = [float(len(q.head) - i) for i in range(len(q.head))]

    def _doc_text(self, q: RerankQuery, doc_id: str) -> str:
        """A document as the sets show it (:meth:`prepared`: Rank-R1 cuts it to ``max_doc_tokens``
        tokens of the model's tokenizer), made once per query."""
        if doc_id not in q.texts:
            q.texts[doc_id] = self.prepared(q.corpus[doc_id])
        return q.texts[doc_id]

    def _query_text(self, q: RerankQuery) -> str:
        """The query, cut to ``max_query_tokens`` tokens when set (Rank-R1 cuts it as its documents)."""
        n = self.spec.max_query_tokens
        return self.passage_cut().cut(q.request.query, n) if n else q.request.query

    @staticmethod
    def _advance(n: int, q: RerankQuery, sorts: dict[int, Comparisons], pending: dict[int, list[int]],
                 answer: int | None) -> None:
        """Send query ``n``'s heap sort its answer (None: start it); keep its next set pending, or
        put its documents in their new order when it is done."""
        try:
            pending[n] = next(sorts[n]) if answer is None else sorts[n].send(answer)
        except StopIteration as done:
            pending.pop(n, None)
            q.head = [q.head[i] for i in done.value]

    def _stats(self, queries: list[RerankQuery]) -> dict[str, Any]:
        records = [r for q in queries for r in q.records]
        return {"parse": self.spec.parse, "num_child": self.spec.num_child, "select_k": self.spec.select_k, "comparisons": len(records),
                "rounds": max((r["round"] for r in records), default=0),
                "answers_read": {h: sum(1 for r in records if r["read"] == h) for h in HOW}}


def _shuffled(positions: list[int], rng: random.Random) -> list[int]:
    """The set in the order it is shown (Rank-R1 shows each set shuffled)."""
    return rng.sample(positions, len(positions))
