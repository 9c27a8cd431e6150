"""Hostile corpora: BM25 indexing time and MiniLM peak memory on one 50 MB document of normal text,
one 50 MB word, and a few words followed by 50 MB of spaces, each beside the normal text's figure
(target: within 2x of it).

* Normal text: sentences of the docstrings of the standard library (``benchmarks/realtext.py``),
  repeated to the size. The word: ``ACGT`` repeated (a DNA string: base64 or a minified blob behave
  the same). Spaces: ``a few words about insulin and glucose`` then spaces.
* BM25: ``BM25Retriever.for_task`` on a corpus of that one document (analysis, index and its
  save into a fresh folder), timed; before issue 29 the word took hours (each 255-character cut
  matched the rest of the word again).
* MiniLM (the ``minilm`` entry, transformers on the CPU, float32): ``encode`` of the document,
  timed, and the peak resident memory of the process (model and text included); before, a cut
  that fell short of 256 tokens sent the whole document to the tokenizer: 3.4 GB for the word or
  the spaces, 1 GB for normal text.

Each case runs in a process of its own, so its peak memory (``ru_maxrss``) is its own.

Issue 39 item 11 (huge words outside MiniLM's own path; :func:`outside_minilm`): the same
documents through the vLLM encoder's token ids (``VLLMEncoder.token_ids``: the tokenizer's work,
no engine started), an API encoder's ``hf_tokenizer`` cut (``APIEncoder.truncate`` with MiniLM's
WordPiece tokenizer at ``max_tokens: 256``; it also prints how many characters would be sent) and
a cross-encoder's (query, document) pair tokenization at 512 tokens (``pair_token_ids``). Before,
each tokenized the whole text (a 20 MB word: 15.6 s and 1.75 GB for the vLLM ids, 16 s for the
pairs; a 50 MB word: 53 s and 3.27 GB for the API cut, which then sent all of it).

Usage: ``python benchmarks/hostile.py [--mb 50] [--only bm25|minilm|vllm-ids|api-cut|pairs]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("normal", "word", "spaces")


def document(kind: str, size: int) -> str:
    """The ``size``-character document of ``kind``."""
    if kind == "word":
        return ("ACGT" * (size // 4 + 1))[:size]
    if kind == "spaces":
        head = "a few words about insulin and glucose "
        return head + " " * (size - len(head))
    from realtext import sentence_pool  # benchmarks/realtext.py

    text = " ".join(sentence_pool(200_000)[0])
    return (text * (size // len(text) + 1))[:size]


def _bm25(text: str) -> float:
    import hashlib

    from r2med_agent.retrieval.bm25.retriever import BM25Retriever
    from r2med_agent.types import Doc, Query, Task

    task = Task(name="hostile", family="qa", domain="medical", queries=(Query("q0", "insulin"),),
                corpus=(Doc("d0", text),), qrels={}, source="benchmarks/hostile.py",
                fingerprint=hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
    with tempfile.TemporaryDirectory() as index_root:
        t0 = time.perf_counter()
        BM25Retriever.for_task(task, index_root=index_root, show_progress=False)
        return time.perf_counter() - t0


def _minilm(text: str) -> float:
    from r2med_agent.retrieval.dense.factory import make_encoder

    encoder = make_encoder("minilm")
    encoder.encode(["load the model first"], side="doc")
    t0 = time.perf_counter()
    encoder.encode([text], side="doc")
    return time.perf_counter() - t0


def child(what: str, kind: str, mb: float) -> None:
    """One case in this process: print its seconds and peak resident memory as JSON."""
    text = document(kind, int(mb * 1_000_000))
    extra: dict = {}
    if what in OUTSIDE_MINILM:
        seconds, extra = OUTSIDE_MINILM[what](text)
    else:
        seconds = _bm25(text) if what == "bm25" else _minilm(text)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"what": what, "kind": kind, "seconds": seconds, "peak_mb": peak_mb, **extra}))


def run_case(what: str, kind: str, mb: float, timeout_s: float) -> dict:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), str(here),
                                                                       os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", what, kind, str(mb)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"what": what, "kind": kind, "seconds": None, "peak_mb": None,
                "note": f"still running after {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"what": what, "kind": kind, "seconds": None, "peak_mb": None,
                "note": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["wall_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0, help="size of each document in MB (default 50)")
    ap.add_argument("--only", choices=("bm25", "minilm", *OUTSIDE_MINILM), help="run one of the benchmarks")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one case may take (default 900)")
    ap.add_argument("--child", nargs=3, metavar=("WHAT", "KIND", "MB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], float(args.child[2]))
        return
    print(f"hostile corpora: one {args.mb:g} MB document each; target: within 2x of normal text")
    for what, measure in (("bm25", "seconds"), ("minilm", "peak_mb")):
        if args.only and what != args.only:
            continue
        rows = {kind: run_case(what, kind, args.mb, args.timeout) for kind in KINDS}
        base = rows["normal"][measure]
        for kind, row in rows.items():
            figure = row[measure]
            ratio = "" if not (figure and base) else f"{figure / base:.2f}x normal"
            verdict = "" if kind == "normal" or not ratio else ("met" if figure <= 2 * base else "NOT met")
            print(f"{what:7s} {kind:7s} time {row['seconds'] or 0:8.2f} s  peak RSS {row['peak_mb'] or 0:7.0f} MB  "
                  f"{measure}: {ratio} {verdict} {row.get('note', '')}".rstrip())
    outside_minilm(args)


# --------------------------------------------------------------------------- issue 39 item 11
# Huge words outside MiniLM's own path: the vLLM encoder's token ids, an API encoder's
# hf_tokenizer cut, a cross-encoder's pairs. Each beside normal text's time and memory.


def _minilm_spec():
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    return get_encoder_spec("minilm")


def _vllm_ids(text: str) -> tuple[float, dict]:
    from r2med_agent.retrieval.dense.vllm import VLLMEncoder

    encoder = VLLMEncoder(_minilm_spec(), device="cpu")
    encoder.token_ids(["load the tokenizer first"], side="doc")
    t0 = time.perf_counter()
    ids = encoder.token_ids([text], side="doc")
    return time.perf_counter() - t0, {"tokens": len(ids[0])}


def _api_cut(text: str) -> tuple[float, dict]:
    import dataclasses

    from r2med_agent.retrieval.dense.api import APIEncoder
    from r2med_agent.retrieval.dense.models import resolve_model_path
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    spec = dataclasses.replace(get_encoder_spec("voyage"), max_tokens=256, json_inputs=False,
                               hf_tokenizer=resolve_model_path(_minilm_spec().model))
    encoder = APIEncoder(spec)
    encoder.truncate(["load the tokenizer first"])
    t0 = time.perf_counter()
    sent = encoder.truncate([text])
    return time.perf_counter() - t0, {"sent_chars": len(sent[0])}


def _pairs(text: str) -> tuple[float, dict]:
    from transformers import AutoTokenizer

    from r2med_agent.retrieval.dense.models import resolve_model_path
    from r2med_agent.retrieval.rerank.cross_encoder import pair_token_ids

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(_minilm_spec().model))
    t0 = time.perf_counter()
    ids, _ = pair_token_ids(tokenizer, [("what lowers blood sugar", text)], 512)
    return time.perf_counter() - t0, {"tokens": len(ids[0])}


OUTSIDE_MINILM = {"vllm-ids": _vllm_ids, "api-cut": _api_cut, "pairs": _pairs}
"""Issue 39 item 11's cases: name -> (seconds, what else to print) of one document."""


def outside_minilm(args: argparse.Namespace) -> None:
    """Item 11's rows: time and peak memory of each case beside normal text's (target: within 2x)."""
    for what in OUTSIDE_MINILM:
        if args.only and what != args.only:
            continue
        rows = {kind: run_case(what, kind, args.mb, args.timeout) for kind in KINDS}
        base_s, base_mb = rows["normal"]["seconds"], rows["normal"]["peak_mb"]
        for kind, row in rows.items():
            seconds, peak = row["seconds"], row["peak_mb"]
            ratios = "" if kind == "normal" or not (seconds and peak and base_s and base_mb) else (
                f"{seconds / base_s:.2f}x / {peak / base_mb:.2f}x normal "
                + ("met" if peak <= 2 * base_mb else "NOT met"))
            sent = f"  sends {row['sent_chars']:,} chars" if "sent_chars" in row else ""
            print(f"{what:8s} {kind:7s} time {seconds or 0:8.2f} s  peak RSS {peak or 0:7.0f} MB  {ratios}"
                  f"{sent} {row.get('note', '')}".rstrip())


if __name__ == "__main__":
    main()
