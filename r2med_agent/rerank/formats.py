"""The input and answer formats of published LLM rerankers (``format:`` of a reranker entry), as
pure parts: what the model reads besides the prompt template, and how its answer is read.

* **ReasonRank** (``format: reasonrank``, listwise; 8421BCD/ReasonRank, prompt mode
  ``rank_GPT_reasoning``): a system message (:data:`REASONRANK_SYSTEM`), the window's passages
  numbered ``[1]``..., reasoning in ``<think>`` and the order in ``<answer>[2] > [1]</answer>``.
  Bracketed numbers inside the query and the passages are rewritten ``(n)``
  (:func:`replace_numbers`), as ReasonRank does, so they cannot be mistaken for identifiers. The
  order is read from the answer block (:func:`answer_block`).
* **Rank1** (``format: rank1``, pointwise; orionw/rank1): a raw text (no chat template) ending in
  ``<think>``; the model reasons, closes ``</think>`` and writes `` true`` or `` false``.
  Generation stops at ``</think> true`` / ``</think> false``; the score is
  P(true) / (P(true) + P(false)) of the judgment token (:func:`true_probability`). An answer
  without both tokens among the last position's top log-probabilities is ended by force: its
  text is cut after its last full sentence and ``</think>`` appended (:func:`forced_end`), and
  one more token, restricted to the two (Rank1's ``allowed_token_ids``), is scored the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

REASONRANK_SYSTEM = (
    # Verbatim: 8421BCD/ReasonRank, listwise_prompt_r1.toml, system_prompt_reasoning (the system
    # message of prompt mode rank_GPT_reasoning, which the released models were trained with).
    "You are RankLLM, an intelligent assistant that can rank passages based on their relevance to the query. "
    "Given a query and a passage list, you first thinks about the reasoning process in the mind and then "
    "provides the answer (i.e., the reranked passage list). The reasoning process and answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think> <answer> answer here </answer>."
)

# ReasonRank's answer pattern (listwise_prompt_r1.toml ``pattern``), matched on the lower-cased text.
_REASONRANK_ANSWER_RE = re.compile(r"<think>.*?</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_BRACKET_NUMBER_RE = re.compile(r"\[(\d+)\]")

RANK1_STOPS = ("</think> true", "</think> false")
"""Rank1's stop strings (orionw/rank1, rank1.py): generation ends with the judgment token."""

RANK1_TRUE, RANK1_FALSE = " true", " false"
"""The judgment tokens whose probabilities make the score (with their leading space, as Rank1
takes their ids from the tokenizer)."""

_SENTENCE_END = (".", "!", "?")


def replace_numbers(text: str) -> str:
    """``[12]`` written ``(12)``, as ReasonRank does to the query and every passage."""
    return _BRACKET_NUMBER_RE.sub(r"(\1)", text)


def answer_block(text: str) -> tuple[str, bool]:
    """The part of a ReasonRank answer that holds the order, and whether it was a whole
    ``<think>...</think> <answer>...</answer>`` block.

    As ReasonRank reads it: the inside of the answer block; failing that, what follows the last
    ``<answer>``; failing that, the whole text (then the order is repaired from whatever numbers
    it holds).
    """
    m = _REASONRANK_ANSWER_RE.search(text.lower())
    if m:
        return m.group(1).strip(), True
    if "<answer>" in text:
        return text.split("<answer>")[-1], False
    return text, False


def reasonrank_numbers(answer: str) -> list[int] | None:
    """The numbers ReasonRank reads from an answer block (``_clean_response`` and
    ``receive_permutation`` of its ``rerank/rankllm.py``): every character that is not a digit
    (``str.isdigit``) becomes a space, and each remaining run is a number. None when a run is
    not one (``int`` refuses digits such as superscripts): ReasonRank then leaves the window as
    it was."""
    spaced = "".join(c if c.isdigit() else " " for c in answer)
    try:
        return [int(x) for x in spaced.split()]
    except ValueError:
        return None


def true_probability(top: Sequence[tuple[str, float]] | None) -> float | None:
    """P(true) / (P(true) + P(false)) of one position's top tokens; None unless both the
    `` true`` and the `` false`` token are among them (Rank1 then ends the answer by force)."""
    if not top:
        return None
    found = {tok: lp for tok, lp in reversed(top)}  # the best-ranked spelling wins
    if RANK1_TRUE not in found or RANK1_FALSE not in found:
        return None
    t, f = math.exp(found[RANK1_TRUE]), math.exp(found[RANK1_FALSE])
    return t / (t + f)


def rank1_judgment(text: str, stop_reason: str | None) -> bool | None:
    """The judgment of a Rank1 answer without log-probabilities: the stop string that ended it,
    else the last ``true``/``false`` after its last ``</think>``; None when there is none."""
    if stop_reason in RANK1_STOPS:
        return stop_reason == RANK1_STOPS[0]
    if "</think>" not in text:
        return None
    words = re.findall(r"\b(true|false)\b", text.rsplit("</think>", 1)[1], re.IGNORECASE)
    return None if not words else words[-1].lower() == "true"


def judgment_point(prompt: str, generated: str, *, force: bool) -> str:
    """The raw text whose next token is the judgment: an answer that stopped at its judgment
    continued right after its ``</think>`` (the stop string was left out of ``generated``), or,
    with ``force``, ended by force (:func:`forced_end`)."""
    return forced_end(prompt, generated) if force else f"{prompt}{generated}</think>"


def forced_end(prompt: str, generated: str) -> str:
    """The raw text that makes Rank1 judge now: the prompt, the answer cut after its last full
    sentence (when it does not end with one), and ``</think>``; the next token is the judgment."""
    text = generated.rstrip()
    if not text.endswith(_SENTENCE_END):
        last = max(text.rfind(c) for c in _SENTENCE_END)
        if last != -1:
            text = text[: last + 1]
    return f"{prompt}\n{text.strip()}\n</think>"
