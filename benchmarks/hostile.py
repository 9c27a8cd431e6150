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

Prompt templates (issue 39): each hostile template of the issue rendered in the sandbox with its
limits (nested ``range(99999)`` loops, ``range(10**9)``, ``'x' * 10**10``, ``indent(10**10)``, a
recursive and a doubling macro, a self-include): seconds to the one-line error and peak memory,
beside a normal template's.

Files and answers (issue 39 items 8-10 and 12, below): GroupRank answers, ids, YAML values and a
damaged generation cache, each beside its normal input.

Hostile servers (issue 39 items 4-6, :func:`servers_main`): time and peak resident memory of the
client (a process of its own; the server is a loopback one in this process, ``tests/hostile_http.py``)
for 12 chat requests answered normally, by a 2 MB gzip inflating to 2 GB, an endless chunked body,
a JSON nested 3,000 deep; one request to a server trickling a byte a second (``timeout_s`` 3,
``max_retry_s`` 6); the same for ``/embeddings``; and a pinned prompt file fetched normally,
declared as 6 GB, or 1 GB on a ``file://`` mirror. Before: 7.15 GB and a MemoryError for the gzip,
a RecursionError for the nesting, no end to the trickle, 1.09 GB and a MemoryError for the files.

Issue 39 item 11 (huge words outside MiniLM's own path; :func:`outside_minilm`): the same
documents through the vLLM encoder's token ids (``VLLMEncoder.token_ids``: the tokenizer's work,
no engine started), an API encoder's ``hf_tokenizer`` cut (``APIEncoder.truncate`` with MiniLM's
WordPiece tokenizer at ``max_tokens: 256``; it also prints how many characters would be sent) and
a cross-encoder's (query, document) pair tokenization at 512 tokens (``pair_token_ids``). Before,
each tokenized the whole text (a 20 MB word: 15.6 s and 1.75 GB for the vLLM ids, 16 s for the
pairs; a 50 MB word: 53 s and 3.27 GB for the API cut, which then sent all of it).

Usage: ``python benchmarks/hostile.py [--mb 50] [--only bm25|minilm|vllm-ids|api-cut|pairs|templates|files|servers]``
(without ``--only``: the templates, the servers, the corpora, item 11's cases, then the files).
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
    if what == "template":
        template_child(kind)
        return
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


# -- files the tool trusts and GroupRank's answers (issue 39 items 8-10, 12) ----------------------
#
# Each case beside its normal input, in a process of its own: seconds and peak resident memory.
#   grouprank: the lenient and the strict reading of a normal answer (ten scores after 2 kB of
#     reasoning) and of answers ending in 2,000 and 100,000 spaces (before: 45 s for 2,000).
#   ids: a 100,000-document corpus in R2MED's layout written and loaded with ASCII ids, and with ids that are
#     not ASCII (each checked character by character and for NFKC twins).
#   yaml: a user config holding a 50,000-character string, and one holding a 50,000-digit integer
#     (now refused with file:line).
#   cache: ``cache stats`` on a sound 2,000-generation cache and on one with zeros at 4-12 kB (now
#     one line), then ``cache repair`` of one with 4 kB of random bytes a third in.

FILES_CASES = {
    "grouprank": ("normal", "2000 spaces", "100000 spaces"),
    "ids": ("ascii", "not ascii"),
    "yaml": ("normal", "50000 digits"),
    "cache": ("sound", "damaged", "repair"),
}


def _grouprank(kind: str) -> None:
    from r2med_agent.rerank.groupwise import grouprank_answer, parse_group_scores

    scores = ", ".join(f'"[{i}]": {i % 10}' for i in range(1, 11))
    text = ("The passages differ in how closely they match. " * 45 + f"<answer>{{{scores}}}</answer>"
            if kind == "normal" else '<answer>{"[1]": 7' + " " * int(kind.split()[0]))
    parse_group_scores(text, 10)
    grouprank_answer(text)


def _ids(kind: str, folder: Path) -> None:
    from r2med_agent.data import load_task_dir

    name = (lambda i: f"doc_{i}") if kind == "ascii" else (lambda i: f"Ärztin_Übersicht_{i}")
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(100_000):
            f.write(json.dumps({"id": name(i), "text": f"document {i} about insulin"}, ensure_ascii=False) + "\n")
    (folder / "query.jsonl").write_text(json.dumps({"id": "q0", "text": "insulin"}) + "\n")
    (folder / "qrels.jsonl").write_text(json.dumps({"q_id": "q0", "p_id": name(3), "score": 1}) + "\n")
    load_task_dir(folder, name="ids", family="qa", domain="medical", use_task_cache=False)


def _yaml(kind: str, folder: Path) -> None:
    from r2med_agent.config import read_yaml
    from r2med_agent.errors import ConfigError

    value = f'"{"7" * 50_000}"' if kind == "normal" else "7" * 50_000  # the same text: a string, a number
    path = folder / "user.yaml"
    path.write_text(f"llms:\n  mine:\n    model: x/y\n    about: {value}\n")
    try:
        read_yaml(path)
    except ConfigError:
        pass


def _cache(kind: str, folder: Path) -> None:
    import random as rnd

    from r2med_agent.errors import DataError
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.repair import repair
    from r2med_agent.llm.cache.records import CacheRecord, Use, build_request
    from r2med_agent.types import Generation

    path = folder / "gen.sqlite"
    cache = GenerationCache(path)
    records = [CacheRecord.from_generation(f"k{i}", build_request("m", [{"role": "user", "content": str(i)}], {}),
                                           Generation(text="x" * 300, final="x" * 300)) for i in range(2000)]
    cache.put_many(records, uses=[Use(f"k{i}", "t", str(i), "hyde", {}) for i in range(2000)])
    cache.close()
    data = bytearray(path.read_bytes())
    if kind == "damaged":
        data[4096:12288] = bytes(8192)
    elif kind == "repair":
        data[len(data) // 3:len(data) // 3 + 4096] = rnd.Random(39).randbytes(4096)
    path.write_bytes(bytes(data))
    try:
        repair(path) if kind == "repair" else GenerationCache(path).stats()
    except DataError:
        pass


def files_child(what: str, kind: str) -> None:
    """One case of :data:`FILES_CASES` in this process: seconds (of the case alone) and peak RSS."""
    import r2med_agent.config  # noqa: F401 - imported first: the figures are the cases' alone
    import r2med_agent.data  # noqa: F401
    import r2med_agent.llm.cache.repair  # noqa: F401
    import r2med_agent.rerank.groupwise  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if what == "grouprank":
            _grouprank(kind)
        else:
            {"ids": _ids, "yaml": _yaml, "cache": _cache}[what](kind, Path(tmp))
        seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"what": what, "kind": kind, "seconds": seconds, "peak_mb": peak_mb}))


def files_cases(timeout_s: float) -> None:
    """Print each case of :data:`FILES_CASES` beside its normal input's figures."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")]))}
    print("files and answers (issue 39): each case beside its normal input")
    for what, kinds in FILES_CASES.items():
        base = None
        for kind in kinds:
            try:
                done = subprocess.run([sys.executable, __file__, "--files-child", what, kind], env=env,
                                      capture_output=True, text=True, timeout=timeout_s)
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
                note = "" if row else f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
            except subprocess.TimeoutExpired:
                row, note = None, f"still running after {timeout_s:.0f} s"
            if row is None:
                print(f"{what:9s} {kind:14s} {note}")
                continue
            base = base or row
            ratio = f"{row['seconds'] / base['seconds']:.2f}x the time of {base['kind']}" if row is not base else ""
            print(f"{what:9s} {kind:14s} time {row['seconds']:8.3f} s  peak RSS {row['peak_mb']:6.0f} MB  {ratio}".rstrip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0, help="size of each document in MB (default 50)")
    ap.add_argument("--only", choices=("bm25", "minilm", *OUTSIDE_MINILM, "templates", "files", "servers"),
                    help="run one of the benchmarks (files: issue 39's files and GroupRank answers)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one case may take (default 900)")
    ap.add_argument("--child", nargs=3, metavar=("WHAT", "KIND", "MB"), help=argparse.SUPPRESS)
    ap.add_argument("--files-child", nargs=2, metavar=("WHAT", "KIND"), help=argparse.SUPPRESS)
    ap.add_argument("--server-child", nargs=3, metavar=("WHAT", "KIND", "URL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], float(args.child[2]))
        return
    if args.files_child:
        files_child(*args.files_child)
        return
    if args.server_child:
        server_child(*args.server_child)
        return
    if args.only in (None, "templates"):
        run_templates(min(args.timeout, 120.0))
    if args.only in (None, "servers"):
        servers_main(args.timeout)
    if args.only == "files":
        files_cases(args.timeout)
    if args.only in ("templates", "files", "servers"):
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
    if not args.only:
        files_cases(args.timeout)


# -- prompt templates (issue 39 item 3) --------------------------------------------------------
# Each hostile template of the issue, rendered as a run renders HyDE's prompt (the sandbox with its
# limits, R2MED_PROMPTS_DIR's layout), in a process of its own: its seconds to the one-line error
# and its peak memory, beside a normal template's. Before the limits, the nested loops ran past
# 60 s and the others ended in tracebacks (MemoryError, OverflowError, RecursionError).

TEMPLATES = {
    "normal": "Please write a passage that helps answer the following {{ domain }} post.\nPost: {{ query }}\n",
    "nested range(99999)": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "range(10**9)": "{% for i in range(10**9) %}{% endfor %}",
    "'x' * 10**10": "{{ 'x' * 10**10 }}",
    "indent(10**10)": "{{ query|indent(10**10) }}",
    "recursive macro": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "doubling macro": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d(query, 60) }}",
    "self-include": "{% include 'hyde/qa.j2' %}",
}


def template_child(case: str) -> None:
    """Render one of :data:`TEMPLATES` in this process; print seconds, peak memory and outcome."""
    from r2med_agent.prompts import templates as prompt_templates
    from r2med_agent.errors import ConfigError

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "hyde").mkdir()
        (Path(folder) / "hyde" / "qa.j2").write_text(TEMPLATES[case], encoding="utf-8")
        t0 = time.perf_counter()
        try:
            prompt_templates.render("hyde/qa.j2", prompts_dir=folder, query="what is insulin", domain="medical")
            outcome = "rendered"
        except ConfigError as e:
            outcome = str(e).replace(folder, "<prompts>")
        seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"what": "template", "kind": case, "seconds": seconds, "peak_mb": peak_mb, "note": outcome}))


def run_templates(timeout_s: float) -> None:
    print("hostile prompt templates: seconds to the error and peak RSS of the process, beside a normal template")
    for case in TEMPLATES:
        row = run_case("template", case, 0, timeout_s)
        print(f"template {case:20s} time {row['seconds'] or 0:7.3f} s  peak RSS {row['peak_mb'] or 0:6.0f} MB  "
              f"{row.get('note', '')}")



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

    from r2med_agent.prompts import sources as prompt_sources  # noqa: F401
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
            from r2med_agent.prompts import sources as prompt_sources

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
    from r2med_agent.rerank.cross_encoder import pair_token_ids

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
