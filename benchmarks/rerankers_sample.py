"""Every offline LLM reranker entry end to end on the whole embedded ``sample`` task (12 queries),
on each backend: the local llama.cpp model, the vLLM engine, and vLLM's OpenAI server.

Each run is what ``r2med-agent run --task sample --reranker NAME --rerank-k K`` does (BM25 first
stage, the entry's kind, format, prompts and parsing as shipped, a fresh generation cache). On
vLLM the entry's LLM is replaced by an engine (or a server) over ``--model``, the SmolLM2-135M
checkpoint of the test tier; where the entry's answer syntax is beyond a 135M model (a window's
order, ReasonRank's blocks, Rank1's judgment) the vLLM entry forces its shape with structured
outputs, and the other kinds' answers are repaired and counted as shipped.

Printed per entry and backend: nDCG@10, the reranker's prompts (windows, pairs, groups or
comparisons), generations, answers repaired or without a judgment, wall seconds, and for the
server the queries whose final ranking equals the engine's (greedy decoding on a CPU engine
depends on what shares a batch, so near-ties may fall otherwise).

Run from the repository root: ``VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/rerankers_sample.py
--model DIR [--backends local,engine,server] [--rerankers smollm2-listwise,...] [--k 10]``
(``python -m tests.vllm_model`` makes DIR; ``--backends local`` needs no vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

RERANKERS = ("smollm2-listwise", "smollm2-pointwise", "smollm2-reasonrank", "smollm2-insertrank",
             "smollm2-rank1", "smollm2-groupwise", "smollm2-setwise")
_ORDER = r"\[[1-4]\] > \[[1-4]\] > \[[1-4]\] > \[[1-4]\]"
FORCED = {  # the answer shapes a 135M model cannot write (windows of 4)
    "listwise": _ORDER,
    "insertrank": _ORDER,
    "reasonrank": r"<think>[a-z ]{1,24}</think>\n<answer>" + _ORDER + "</answer>",
    "rank1": r"[a-z ]{1,24}\.\n</think> (true|false)",
}


def _forced(spec) -> str | None:  # noqa: ANN001 - RerankerSpec
    return FORCED.get(spec.format if spec.format != "default" else spec.kind)


def _user_config(path: Path, backend: str, names: list[str], model: str, base_url: str | None) -> dict[str, str]:
    """A user config whose rerankers are the shipped entries over the vLLM engine or server;
    returns shipped name -> its copy's name."""
    from r2med_agent.rerank.spec import get_reranker_spec
    from tests.vllm_server import ENGINE_SETTINGS

    # The server's engine settings (tests/vllm_server.py), both without prefix caching.
    engine = {**ENGINE_SETTINGS, "seed": None,
              "engine_kwargs": {**ENGINE_SETTINGS["engine_kwargs"], "enable_prefix_caching": False}}
    llms, rerankers, renamed = {}, {}, {}
    for i, name in enumerate(names):
        spec = get_reranker_spec(name)
        llm = f"smol-{backend}-{i}"
        if backend == "engine":
            entry = {"backend": "vllm", "model": model, **engine}
        else:
            entry = {"backend": "openai", "server": "vllm", "model": "smol", "base_urls": [base_url],
                     "tokenizer": model, "seed": None}
        regex = _forced(spec)
        if regex:
            entry["extra_body"] = {"structured_outputs": {"regex": regex}}
        llms[llm] = entry
        fields = {k: v for k, v in asdict(spec).items() if k != "name" and v is not None}
        rerankers[f"{name}-{backend}"] = {**fields, "llm": llm}
        renamed[name] = f"{name}-{backend}"
    path.write_text(json.dumps({"llms": llms, "rerankers": rerankers}, indent=1))  # JSON is YAML
    return renamed


def _run(name: str, k: int, out: Path) -> dict:
    from r2med_agent.api import RunConfig, run_experiment

    cfg = RunConfig(tasks=("sample",), reranker=name, rerank_k=k, output_dir=out / "results",
                    cache_path=out / f"{name}.sqlite", show_progress=False)
    t0 = time.perf_counter()
    result = run_experiment(cfg)
    wall = time.perf_counter() - t0
    stats = result.outcomes[0].stats["rerank"]
    ranked = {}
    with (result.result_dir / "sample.run").open(encoding="utf-8") as f:
        for line in f:
            qid, _, doc, rank, *_ = line.split()
            ranked.setdefault(qid, []).append((int(rank), doc))
    prompts = stats.get("windows", stats.get("pairs", stats.get("groups", stats.get("comparisons", 0))))
    flawed = (stats.get("answers_repaired", 0) or stats.get("no_judgment", 0)
              or stats.get("answers_read", {}).get("unanswered", 0))
    return {"ndcg": result.average["ndcg_at_10"], "prompts": prompts, "generations": stats["generations"], "flawed": flawed,
            "wall": wall, "ranking": {q: [d for _, d in sorted(v)] for q, v in ranked.items()}}


def _backend_runs(backend: str, names: list[str], args: argparse.Namespace, work: Path) -> dict[str, dict]:
    from r2med_agent.config import set_user_config

    work.mkdir(parents=True, exist_ok=True)
    if backend == "local":
        return {n: _run(n, args.k, work) for n in names}
    server = None
    if backend == "server":
        from tests.vllm_server import VLLMServer

        server = VLLMServer(Path(args.model), work, timeout_s=900, served_model_name="smol",
                            extra_args=["--no-enable-prefix-caching"])
        server.start()
    try:
        user = work / f"{backend}.yaml"
        renamed = _user_config(user, backend, names, args.model, server.base_url if server else None)
        set_user_config(user)
        try:
            return {n: _run(renamed[n], args.k, work) for n in names}
        finally:
            set_user_config(None)
    finally:
        if server is not None:
            server.stop()
        else:
            from r2med_agent.llm.vllm_backend import close_engines

            close_engines()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="SmolLM2 folder in Hugging Face format (vLLM backends)")
    ap.add_argument("--backends", default="local,engine,server", help="comma-separated: local, engine, server")
    ap.add_argument("--rerankers", default=",".join(RERANKERS), help="comma-separated offline reranker entries")
    ap.add_argument("--k", type=int, default=10, help="candidates reranked per query (BM25's top k)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.vllm_server, run as a script
    names = [n.strip() for n in args.rerankers.split(",") if n.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any(b != "local" for b in backends) and not args.model:
        ap.error("--model is needed for the engine and server backends")
    print(f"sample (12 queries), BM25 top {args.k} reranked; vLLM model: {args.model or '-'}")
    print(f"{'reranker':20} {'backend':8} {'nDCG@10':>8} {'prompts':>8} {'gens':>6} {'flawed':>7} {'wall s':>8} "
          f"{'same as engine':>15}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for backend in backends:
            runs[backend] = _backend_runs(backend, names, args, Path(tmp) / backend)
        for n in names:
            for backend in backends:
                r = runs[backend][n]
                same = ""
                if backend == "server" and "engine" in runs:
                    mine, theirs = r["ranking"], runs["engine"][n]["ranking"]
                    same = f"{sum(mine[q] == theirs.get(q) for q in mine)}/{len(mine)}"
                print(f"{n:20} {backend:8} {r['ndcg']:8.4f} {r['prompts']:8d} {r['generations']:6d} "
                      f"{r['flawed']:7d} {r['wall']:8.1f} {same:>15}", flush=True)


if __name__ == "__main__":
    main()
