"""Fixed inputs for the embedder cases of the conformance suite, and the project's side of each
comparison.

Inputs: the packaged ``sample`` task (12 queries, 122 documents) plus hostile texts: unicode of
every kind (combining marks, emoji sequences, right-to-left, zero-width and line-separator
characters), an empty and a blank text, literal special-token and format-brace text, and a
20,000-word text; documents carry odd ids (spaces, slashes, newlines, unicode, an empty id).

The project's side goes through the functions its backends run: the prefix from
:func:`~r2med_agent.retrieval.dense.instructions.instruction_prefixes`, the strings through
:func:`~r2med_agent.retrieval.dense.cache.encode_corpus` (documents) or the query path, the cut of
``decoded-text`` entries through :func:`~r2med_agent.retrieval.dense.tokens.decoded_text_cut`, and
the token ids through the transformers backend's ``_tokenize`` (with its character bound) and the
vLLM backend's ``token_ids``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r2med_agent.retrieval.dense.spec import EncoderSpec
from r2med_agent.types import Doc

HOSTILE_TEXTS = (
    "",
    "   ",
    "Ünïcödé naïve café, e\u0301 combining, 漢字かな交じり文, emoji 🧬🩺👩🏽\u200d⚕️, RTL שלום עולם, "
    "zero\u200bwidth, soft\u00adhyphen",
    "line one\nline two\r\nthird\u2028fourth\tTabbed\x0bvertical",
    "literal <|endoftext|> and <|embed|> text, {braces} {0} %s \\n backslash-n",
)
WORDS = ("myocardial", "infarction", "troponin", "elevation", "patient", "résumé", "β-blocker", "x")
LONG_TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(20_000))
"""A 20,000-word text: longer than every entry's token limit (DIVER's 16,384 included)."""
ODD_IDS = ("doc with spaces", "../up/a/level", "line\nbreak", "ünï/cödé", "", "0")


def task_prefixes(spec: EncoderSpec, task: str) -> Any:
    """The prefixes the project resolves for ``task`` (its registry family and domain), as a run
    on that task resolves them."""
    from r2med_agent.data import get_task_spec
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes

    ts = get_task_spec(task)
    return instruction_prefixes(spec, task, ts.family, ts.domain)


def sample_task() -> Any:
    from r2med_agent.data.load import load_task

    return load_task("sample")


def queries() -> list[str]:
    """The sample's queries, then the hostile texts and the 20,000-word one."""
    return [q.text for q in sample_task().queries] + [*HOSTILE_TEXTS, LONG_TEXT]


def docs() -> list[Doc]:
    """The sample's documents, then the hostile texts and the 20,000-word one under odd ids."""
    texts = [*HOSTILE_TEXTS, LONG_TEXT]
    odd = [Doc(doc_id=ODD_IDS[i % len(ODD_IDS)] + f"#{i}" * (i >= len(ODD_IDS)), text=t, title="")
           for i, t in enumerate(texts)]
    return list(sample_task().corpus) + odd


def tokenizer_corpus() -> list[str]:
    """What the stand-in tokenizers are trained on: the sample's texts and the short hostile ones
    (the long one repeats their words)."""
    task = sample_task()
    return [q.text for q in task.queries] + [d.text for d in task.corpus] + [*HOSTILE_TEXTS, " ".join(WORDS)]


@dataclasses.dataclass
class _Recorder:
    """An :class:`~r2med_agent.retrieval.dense.spec.Encoder` that records what it is asked to
    embed (``prefix + text``, as both backends form it) and returns zeros."""

    spec: EncoderSpec
    name: str = "recorder"
    seen: list[str] = dataclasses.field(default_factory=list)

    def encode(self, texts: Sequence[str], *, side: str, prefix: str = "", titles: Any = None) -> np.ndarray:
        self.seen.extend(prefix + t for t in texts)
        return np.ones((len(texts), 4), dtype=np.float32)


def project_doc_strings(spec: EncoderSpec, doc_prefix: str, corpus: Sequence[Doc]) -> list[str]:
    """The strings the project embeds for ``corpus``, through ``encode_corpus`` (no cache)."""
    from r2med_agent.retrieval.dense.cache import encode_corpus

    rec = _Recorder(spec)
    encode_corpus(rec, corpus, doc_prefix=doc_prefix, use_cache=False)
    return rec.seen


def project_token_ids(spec: EncoderSpec, folder: Path, strings: Sequence[str], side: str) -> list[list[int]]:
    """The token ids both backends give the model for ``strings`` (prefix already in): the
    transformers backend's ``_tokenize`` and the vLLM backend's ``token_ids``, which must agree."""
    from transformers import AutoTokenizer

    from r2med_agent.retrieval.dense.hf import HFEncoder, _Loaded
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder, vllm_unsupported_reason

    spec = dataclasses.replace(spec, model=str(folder), backend="transformers")
    tok = AutoTokenizer.from_pretrained(folder)
    loaded = _Loaded(tokenizer=tok, replicas=[], dense=[], pad_id=tok.pad_token_id or 0, eos_id=tok.eos_token_id,
                     uses_token_types=False)
    hf_ids, _ = HFEncoder(spec, device="cpu")._tokenize(loaded, list(strings), None, spec.max_length_for(side))
    # The vLLM backend's tokens too, wherever vLLM can run the entry's settings (its own model
    # code aside, which only decides the vectors).
    vspec = dataclasses.replace(spec, backend="auto", trust_remote_code=False)
    if vllm_unsupported_reason(vspec) is None:
        assert VLLMEncoder(vspec).token_ids(strings, side=side) == hf_ids  # type: ignore[arg-type]
    return hf_ids
