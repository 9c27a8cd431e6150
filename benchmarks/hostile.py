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

Hostile servers (issue 39 items 4-6, :func:`servers_main`): time and peak resident memory of the
client (a process of its own; the server is a loopback one in this process, ``tests/hostile_http.py``)
for 12 chat requests answered normally, by a 2 MB gzip inflating to 2 GB, an endless chunked body,
a JSON nested 3,000 deep; one request to a server trickling a byte a second (``timeout_s`` 3,
``max_retry_s`` 6); the same for ``/embeddings``; and a pinned prompt file fetched normally,
declared as 6 GB, or 1 GB on a ``file://`` mirror. Before: 7.15 GB and a MemoryError for the gzip,
a RecursionError for the nesting, no end to the trickle, 1.09 GB and a MemoryError for the files.

Usage: ``python benchmarks/hostile.py [--mb 50] [--only bm25|minilm|servers]``.
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
    seconds = _bm25(text) if what == "bm25" else _minilm(text)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"what": what, "kind": kind, "seconds": seconds, "peak_mb": peak_mb}))


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
    ap.add_argument("--only", choices=("bm25", "minilm", "servers"), help="run one of the benchmarks")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one case may take (default 900)")
    ap.add_argument("--child", nargs=3, metavar=("WHAT", "KIND", "MB"), help=argparse.SUPPRESS)
    ap.add_argument("--server-child", nargs=3, metavar=("WHAT", "KIND", "URL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], float(args.child[2]))
        return
    if args.server_child:
        server_child(*args.server_child)
        return
    if args.only == "servers" or not args.only:
        servers_main(args.timeout)
        if args.only:
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



# ---------------------------------------------------------------------------------------------
# Hostile servers (issue 39 items 4-6): the client's time and peak memory per kind of reply.

SERVER_KINDS = {"llm": ("normal", "gzip-2GB", "chunked-endless", "nested-3000", "trickle"),
                "embeddings": ("normal", "gzip-2GB", "nested-3000", "trickle"),
                "prompt-file": ("normal", "declared-6GB", "file-1GB")}


def _server_answer(kind: str):  # noqa: ANN202 - the ScriptedServer answer for ``kind``
    from hostile_http import (
        chat_reply, deep_json, embeddings_reply, endless_chunked, prompt_of, send, send_gzip_bomb, send_json, trickle,
    )

    def answer(srv, h, path, body, attempt):  # noqa: ANN001, ANN202
        if kind == "normal":
            if path.endswith("/embeddings"):
                return send_json(h, 200, embeddings_reply(body, dims=1024))
            if path.endswith("/chat/completions"):
                return send_json(h, 200, chat_reply(prompt_of(body), "lorem ipsum " * 400))
            return send(h, 200, b"# a pinned prompt file\n" * 100, {"Content-Type": "text/plain"})
        if kind == "gzip-2GB":
            return send_gzip_bomb(h, 2 * 10**9)
        if kind == "chunked-endless":
            return endless_chunked(srv, h)
        if kind == "nested-3000":
            return send(h, 200, deep_json(3000))
        if kind == "trickle":
            return trickle(srv, h, every_s=1.0)
        if kind == "declared-6GB":
            return send(h, 200, b"x", {"Content-Length": str(6 * 10**9)})
        raise ValueError(kind)

    return answer


def server_child(what: str, kind: str, url: str) -> None:
    """One client case in this process: its seconds, peak resident memory and outcome as JSON."""
    import hashlib
    import logging

    import re

    logging.disable(logging.WARNING)
    import openai  # noqa: F401 - imports before the clock starts

    from r2med_agent import prompt_sources  # noqa: F401
    from r2med_agent.retrieval.dense import api  # noqa: F401

    t0 = time.perf_counter()
    outcome = "ok"
    try:
        if what == "llm":
            from r2med_agent.llm.registry import LLMSpec, make_backend
            from r2med_agent.types import SamplingParams

            n = 1 if kind == "trickle" else 12
            spec = LLMSpec(name="bench", backend="openai", model="m", server="openai", base_urls=(url,),
                           max_concurrency=4, timeout_s=3.0, max_retry_s=6.0, max_retries=1, backoff_initial_s=0.05)
            make_backend(spec).generate([[{"role": "user", "content": f"q {i}"}] for i in range(n)],
                                        SamplingParams(max_tokens=8))
        elif what == "embeddings":
            import dataclasses

            from r2med_agent.retrieval.dense import api
            from r2med_agent.retrieval.dense.factory import get_encoder_spec

            api.ATTEMPTS, api.BACKOFF_S = 2, 0.05
            os.environ["R2MED_BENCH_KEY"] = "sk-bench"
            spec = dataclasses.replace(get_encoder_spec("openai"), base_url=url, api_key_env="R2MED_BENCH_KEY",
                                       max_tokens=None, tiktoken_encoding="", json_inputs=False, batch_size=64)
            api.APIEncoder(spec, timeout_s=3.0).encode([f"text {i}" for i in range(256)], side="doc")
        else:
            from r2med_agent import prompt_sources

            with tempfile.TemporaryDirectory() as tmp:
                os.environ["R2MED_CACHE_DIR"] = tmp
                base = url
                if kind == "file-1GB":
                    big = Path(tmp, "mirror", "o/r", "0" * 40, "p.py")
                    big.parent.mkdir(parents=True)
                    with open(big, "wb") as f:
                        f.truncate(2**30)
                    base = Path(tmp, "mirror").as_uri()
                os.environ[prompt_sources.BASE_URL_ENV] = base
                prompt_sources.FETCH_ATTEMPTS = 1
                want = hashlib.sha256(b"# a pinned prompt file\n" * 100).hexdigest()
                prompt_sources.fetch(prompt_sources.PromptSource(name="b", repo="o/r", commit="0" * 40, reader="none",
                                                                 folders=(), files={"p.py": want}))
    except Exception as e:  # noqa: BLE001 - the outcome is what is measured
        text = re.sub(r"at commit 0+:? |of o/r |; retrying.*|\. Without network.*", "",
                      re.sub(r"(?:https?|file)://\S+?(?=:? )", "URL", str(e)))
        outcome = f"{type(e).__name__}: {' '.join(text.split())[:120]}"
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"what": what, "kind": kind, "seconds": seconds, "peak_mb": peak_mb, "outcome": outcome}))


def servers_main(timeout_s: float) -> None:
    """Each kind of hostile reply beside a normal one: the client's seconds and peak RSS."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hostile_http import ScriptedServer, gzip_bomb

    gzip_bomb(2 * 10**9)  # built once, before any timing
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), str(here),
                                                                       str(here.parent / "tests"),
                                                                       os.environ.get("PYTHONPATH")]))}
    print("hostile servers: the client's time and peak RSS (a process each) beside a normal reply's")
    for what, kinds in SERVER_KINDS.items():
        for kind in kinds:
            with ScriptedServer(_server_answer(kind)) as srv:
                url = srv.base_url if what != "prompt-file" else srv.base_url.removesuffix("/v1")
                try:
                    done = subprocess.run([sys.executable, __file__, "--server-child", what, kind, url], env=env,
                                          capture_output=True, text=True, timeout=timeout_s)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                except (subprocess.TimeoutExpired, IndexError, ValueError):
                    row = {"seconds": None, "peak_mb": None, "outcome": "no result (timed out or crashed)"}
            print(f"{what:11s} {kind:15s} time {row['seconds'] or 0:7.2f} s  peak RSS {row['peak_mb'] or 0:6.0f} MB  "
                  f"{row['outcome']}")


if __name__ == "__main__":
    main()
