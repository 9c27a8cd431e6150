"""Generation on a real vLLM engine: the shipped path against the reference's ways, same run.

For the same HyDE prompts and greedy sampling, on one engine model (a folder in Hugging Face
format, e.g. the test model ``python -m tests.vllm_model`` makes):

1. the shipped path: ``CachedLLM`` over the vLLM backend, no cache, ``chunk_size`` None: every
   prompt of the task in ONE ``LLM.chat`` call (continuous batching stays full);
2. the R2MED reference's offline way: 32-prompt ``LLM.chat`` chunks, one after another;
3. the reference's API way: one request at a time to vLLM's OpenAI server on 127.0.0.1
   (started after the offline engine is shut down: one engine at a time);

and the framework's overhead (prompt rendering, keys, parsing: ``overhead_time_s``) as a fraction
of engine time in pass 1.

Run: ``VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/generation_vllm.py --model DIR [--n 64]
[--max-tokens 32] [--repeat 2] [--skip-server]`` (vllm or vllm-cpu installed). ``benchmarks/generation.py
--vllm DIR`` runs it too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.llm.registry import LLMSpec, make_backend
from r2med_agent.methods import get_method
from r2med_agent.types import Query, SamplingParams, Task

ENGINE = {"gpu_memory_utilization": 0.05, "max_model_len": 2048, "engine_kwargs": {"enforce_eager": True}}
QUESTIONS = [
    "Why does the body develop a fever during an infection?",
    "How do antibiotics kill bacteria without harming human cells?",
    "Why do muscles feel sore a day after exercise?",
    "How do vaccines train the immune system?",
    "What determines a person's blood type?",
    "Why can humans not synthesise vitamin C?",
    "What happens in the brain during deep sleep?",
    "Why do some people need glasses as they get older?",
]


def prompts_for(n: int) -> list:
    queries = tuple(Query(f"q{i}", f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})") for i in range(n))
    task = Task(name="Biology", family="qa", domain="biology", queries=queries, corpus=(),
                qrels={}, source="bench", fingerprint="bench")
    return get_method("hyde")().build_prompts(task, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model folder (Hugging Face format)")
    ap.add_argument("--n", type=int, default=64, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2,
                    help="alternating passes of the two offline ways; each keeps its best time")
    ap.add_argument("--skip-server", action="store_true", help="skip the one-at-a-time server peer")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from r2med_agent.llm import vllm_backend

    spec = LLMSpec(name="bench-vllm", backend="vllm", model=args.model, seed=None, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=None)
    prompts = prompts_for(args.n)
    backend = make_backend(spec)
    backend.generate(prompts[:2], params)  # start the engine and warm it up, untimed

    # The two offline ways alternate (one call, chunks, one call, ...) and each keeps its best
    # time, so a burst of other work on a shared machine does not decide the comparison.
    one_calls, chunk_times, overheads = [], [], []
    for _ in range(args.repeat):
        llm = CachedLLM(backend, spec, cache=None, chunk_size=None)
        t0 = time.perf_counter()
        shipped = llm.generate(prompts, params)
        one_calls.append(time.perf_counter() - t0)
        overheads.append(llm.stats.overhead_time_s / max(llm.stats.model_time_s, 1e-9))

        t0 = time.perf_counter()
        chunked = []
        for i in range(0, len(prompts), 32):
            chunked += backend.generate(prompts[i : i + 32], params)
        chunk_times.append(time.perf_counter() - t0)
    one_call, chunks32, overhead = min(one_calls), min(chunk_times), max(overheads)
    same = sum(a.text == b.text for a, b in zip(shipped, chunked))
    vllm_backend.close_engines()

    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" if hasattr(os, "getloadavg") else ""
    print(f"vLLM, {args.n} HyDE prompts, greedy, {args.max_tokens} tokens max "
          f"({sum(g.completion_tokens for g in shipped)} tokens made{load})")
    print(f"  shipped path, one LLM.chat call:   {one_call:7.2f} s  {args.n / one_call:6.2f} gen/s")
    print(f"  reference, 32-prompt chunks:        {chunks32:7.2f} s  {args.n / chunks32:6.2f} gen/s "
          f"({chunks32 / one_call:.2f}x the shipped time; {same}/{args.n} identical texts)")
    print(f"  framework overhead: {100 * overhead:.2f}% of engine time")
    if args.repeat > 1:
        print(f"  (best of {args.repeat} alternating passes; one call: "
              f"{', '.join(f'{t:.1f}' for t in one_calls)} s; chunks: {', '.join(f'{t:.1f}' for t in chunk_times)} s)")
    if args.skip_server:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.vllm_server import VLLMServer

    with tempfile.TemporaryDirectory() as tmp, VLLMServer(Path(args.model), Path(tmp)) as server:
        http = make_backend(LLMSpec(name="bench-http", backend="openai", model=args.model,
                                    server="vllm", base_urls=(server.base_url,), seed=None,
                                    max_concurrency=1, timeout_s=600.0))
        http.generate(prompts[:1], params)  # warm-up, untimed
        t0 = time.perf_counter()
        served = [http.generate([p], params)[0] for p in prompts]
        one_at_a_time = time.perf_counter() - t0
    same = sum(a.text == b.text for a, b in zip(shipped, served))
    print(f"  reference API, 1 request at a time: {one_at_a_time:7.2f} s  {args.n / one_at_a_time:6.2f} gen/s "
          f"({one_at_a_time / one_call:.2f}x the shipped time; {same}/{args.n} identical texts)")


if __name__ == "__main__":
    main()
