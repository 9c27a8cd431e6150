"""Reading one step of a reasoning-search loop: what the generated text asks for (a search, an
answer, or neither), whatever the backend did with the stop strings, and a model's final
response under its reasoning format."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from r2med_agent.types import Generation


@dataclass(frozen=True, slots=True)
class Action:
    """What one generated step asks for.

    Attributes:
        kind: ``search`` (issued a query), ``answer`` (gave a tagged answer) or ``none``.
        body: the step's text in canonical form: cut at the first closing tag, with that tag
            appended when the model closed (or, by the stop string, ended) a search or an answer.
            The same model output gives the same body whatever the backend did with stop strings.
        content: the query or the answer, stripped; empty for ``none``.
    """

    kind: Literal["search", "answer", "none"]
    body: str
    content: str = ""


def parse_output(
    text: str,
    tags: Mapping[str, tuple[str, str]],
    *,
    stop_reason: object = None,
    finish_reason: str = "stop",
    empty_ok: bool = False,
) -> Action:
    """Parse one generated step into an :class:`Action`.

    Args:
        text: the generated text as the backend returned it.
        tags: ``{"search": (open, close), "answer": (open, close)}``; the closing tags are the
            loop's stop strings (``answer`` may be absent, as in Search-o1).
        stop_reason: the stop string the backend reports, if any (may be None, or a token id).
        finish_reason: the backend's finish reason; ``length`` means the text was cut by
            ``max_tokens``, so an unclosed tag at the end is not a finished query.
        empty_ok: a tag with nothing inside is still a search (answer) with an empty query
            (Search-R1's parser reads ``<search> </search>`` so); False: it is ``none``.

    Returns:
        The action. A closing tag found in the text ends the step there (the backend included
        the stop string, maybe followed by whitespace, or ignored the stop and ran on); otherwise
        a reported stop string, or an unclosed opening tag left at the end of a generation that
        stopped (stop reason missing), closes the last opened tag. The content runs from the
        FIRST opening tag of its kind before the closing one, as both originals read it
        (Search-R1's ``<(search|answer)>(.*?)</\1>``, Search-o1's ``extract_between``): in
        ``<search>a<search>b</search>`` the query is ``a<search>b``. A closing tag without its
        opening tag is ``none``, and so is an empty query/answer unless ``empty_ok``.
    """
    closes = {close: kind for kind, (_, close) in tags.items()}
    kind: str | None = None
    head = text
    first = -1
    for close, k in closes.items():
        i = text.find(close)
        if i != -1 and (first == -1 or i < first):
            first, kind = i, k
    if kind is not None:
        head = text[:first]
    elif isinstance(stop_reason, str) and stop_reason.strip() in closes:
        kind = closes[stop_reason.strip()]
    elif finish_reason != "length":
        last = -1
        for k, (open_, close) in tags.items():
            j = text.rfind(open_)
            if j > last and text.find(close, j) == -1:
                last, kind = j, k
    if kind is None:
        return Action("none", text)
    open_, close = tags[kind]
    body = head + close
    j = head.find(open_)
    if j == -1:
        return Action("none", body)
    content = head[j + len(open_) :].strip()
    if not content and not empty_ok:
        return Action("none", body)
    return Action(kind, body, content)  # type: ignore[arg-type]


def final_text(gen: Generation) -> str:
    """The final response of a generation: ``final`` when the reasoning parser ran, else ``text``.

    The caching wrapper fills ``final``/``reasoning``; a bare backend leaves both empty.
    """
    if gen.final or gen.reasoning:
        return gen.final
    return gen.text.strip()


Parser = Callable[[str], tuple[str, str]]
"""``text -> (reasoning, final)``: a model's reasoning-output parser (``CachedLLM.parse``)."""


def plain_parse(text: str) -> tuple[str, str]:
    """The parser of a non-reasoning model: no reasoning, the whole text is the final response."""
    return "", text.strip()


def reasoning_parser(llm: object) -> Parser:
    """The reasoning-output parser of ``llm``: its ``parse`` method (the caching wrapper applies
    the registry entry's ``reasoning_format``), or :func:`plain_parse` for a bare backend."""
    parse = getattr(llm, "parse", None)
    return parse if callable(parse) else plain_parse
