"""Generation throughput and framework overhead on the offline local engine (SmolLM2-135M GGUF).

Compares, for the same HyDE prompts and sampling settings:

1. batched (the shipped path): ``make_llm("smollm2").generate(prompts)`` exactly as ``run`` builds
   it, with the chunk size ``run`` uses for this entry (``chunk_size: auto`` = 4 for the local
   engine: each chunk of misses is one backend call, committed to the cache), cache on and cold;
   then the same call again (every prompt a cache hit). The local llama.cpp backend decodes the
   chats of a call one after another in-process (llama-cpp-python has no batched chat API), so
   here "batched" saves per-request round trips and server overhead, not engine batching; on vLLM
   the same call is one continuous-batching engine run;
2. one request at a time, in-process: the same engine, one ``generate([prompt])`` per prompt,
   no cache (what a caller looping over queries gets);
3. one request at a time over HTTP: the R2MED reference's API path, one OpenAI-compatible chat
   request per prompt, sequentially, to ``python -m llama_cpp.server`` on loopback;

and reports the framework's own overhead per generation (prompt rendering + cache key + lookup +
write + reasoning parsing) as a fraction of model time, plus the same overhead measured at
NanoR2MED scale (876 prompts) with a zero-cost backend. The engine's state cache is emptied before
each timed pass so that no pass reuses another's prompt states.

Run: ``python benchmarks/generation.py [--n 16] [--max-tokens 64] [--skip-http] [--vllm DIR]``
(``--vllm`` first runs ``generation_vllm.py`` on a real vLLM engine with that model folder)
(needs ``pip install 'r2med-agent[local]'``; the default run takes 2-4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from r2med_agent.llm import GenerationCache, default_sampling, make_llm, resolve_chunk_size, resolve_spec
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.llm.local import resolve_gguf
from r2med_agent.methods import get_method
from r2med_agent.types import Generation, Query, Task

QUESTIONS = [
    "Why do onions make people cry when they are cut?",
    "How do antibiotics kill bacteria without harming human cells?",
    "Why does the body develop a fever during an infection?",
    "What causes the nasal cycle that alternates airflow between nostrils?",
    "Why are insects attracted to artificial light at night?",
    "How does caffeine reduce the feeling of tiredness?",
    "Why do some people need glasses as they get older?",
    "What makes a virus different from a bacterium?",
    "Why do muscles feel sore a day after exercise?",
    "How do vaccines train the immune system?",
    "Why can humans not synthesise vitamin C?",
    "What determines a person's blood type?",
    "Why does alcohol make people need to urinate more?",
    "How do plants know which way is up when they grow?",
    "Why do we yawn, and why is it contagious?",
    "What happens in the brain during deep sleep?",
]


def bench_task(n: int) -> Task:
    """An inline Q&A task of ``n`` distinct queries (not benchmark data; only prompts matter)."""
    queries = tuple(
        Query(str(i), QUESTIONS[i % len(QUESTIONS)] + (f" (variant {i // len(QUESTIONS)})" if i >= len(QUESTIONS) else ""))
        for i in range(n)
    )
    return Task("bench", "qa", "biology", queries, (), {}, "inline benchmark prompts", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_one_at_a_time(spec, prompts, params, timeout_s: float = 120.0) -> tuple[float, int]:
    """Sequential chat requests to a loopback llama.cpp server; returns (seconds, completion tokens)."""
    import httpx
    import openai

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(resolve_gguf(spec.model)),
            "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(spec.n_ctx),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server did not start")
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=timeout_s)
        # Warm-up (the server loads the model lazily on some versions), outside the clock.
        client.chat.completions.create(
            model=spec.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
        tokens = 0
        t0 = time.perf_counter()
        for messages in prompts:
            r = client.chat.completions.create(
                model=spec.model,
                messages=[{"role": "system", "content": spec.system_prompt}, *messages],
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=params.seed,
                # Same settings as the in-process engine: llama.cpp's top_k 0 = off, min_p off.
                extra_body={"top_k": max(params.top_k, 0), "min_p": 0.0,
                            "repeat_penalty": params.repetition_penalty},
            )
            tokens += r.usage.completion_tokens if r.usage else 0
        return time.perf_counter() - t0, tokens
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


class ZeroCostBackend:
    """Answers instantly with a fixed reasoning-style text: isolates the framework's overhead."""

    model_id = "zero-cost"

    def generate(self, prompts, params):
        text = "<think>" + "reasoning " * 200 + "</think>" + "passage " * 150
        return [Generation(text=text, prompt_tokens=100, completion_tokens=350) for _ in prompts]


def overhead_at_scale(tmp: Path, n: int = 876) -> tuple[float, float]:
    """Framework seconds per generation for ``n`` prompts: (cold: key+lookup+write+parse, hit)."""
    task = bench_task(n)
    method = get_method("hyde")()
    t0 = time.perf_counter()
    prompts = method.build_prompts(task, None)
    render = time.perf_counter() - t0
    llm = CachedLLM(ZeroCostBackend(), "zero-cost", "think", GenerationCache(tmp / "scale.sqlite"))
    params = replace(default_sampling(resolve_spec("smollm2")), max_tokens=64)
    t0 = time.perf_counter()
    llm.generate(prompts, params, template_hash=method.template_hash(task))
    cold = time.perf_counter() - t0 + render
    t0 = time.perf_counter()
    out = llm.generate(prompts, params, template_hash=method.template_hash(task))
    hit = time.perf_counter() - t0
    if not all(g.cached for g in out):
        raise RuntimeError("second pass should be all cache hits")
    return cold / n, hit / n


def clear_state_cache(backend) -> None:
    """Empty the in-process engine's cache of llama.cpp states (so no pass reuses another's)."""
    model = backend._model().llama
    cache = getattr(model, "cache", None)
    if cache is not None:
        cache.cache_state.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llm", default="smollm2", help="registry name of a local (llama.cpp) entry")
    ap.add_argument("--n", type=int, default=16, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-http", action="store_true", help="skip the one-at-a-time HTTP peer")
    ap.add_argument("--vllm", metavar="DIR", help="also run benchmarks/generation_vllm.py on this "
                    "model folder (a real vLLM engine: one call vs 32-prompt chunks vs the server)")
    args = ap.parse_args()
    if args.vllm:
        cmd = [sys.executable, str(Path(__file__).with_name("generation_vllm.py")), "--model", args.vllm,
               "--n", str(max(args.n, 32))]
        if args.skip_http:
            cmd.append("--skip-server")
        subprocess.run(cmd, check=True)

    spec = resolve_spec(args.llm, {"max_tokens": args.max_tokens})
    params = default_sampling(spec)
    task = bench_task(args.n)
    method = get_method("hyde")()

    load = ", load average %.1f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    print(f"model {spec.model} ({spec.backend}), {args.n} HyDE prompts, max_tokens {args.max_tokens}, "
          f"{os.cpu_count()} CPUs{load}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # Built as `run` builds it: the entry's own chunk size (auto -> per backend).
        llm = make_llm(args.llm, cache_path=tmp / "gen.sqlite", overrides={"max_tokens": args.max_tokens})
        if llm.chunk_size != resolve_chunk_size(spec):
            raise RuntimeError("the benchmark must use the chunk size `run` uses")
        engine = llm.backend.get()
        # Load the model outside the timed region (every path loads it before its clock starts).
        t0 = time.perf_counter()
        engine.generate([[{"role": "user", "content": "Hi"}]], replace(params, max_tokens=1))
        print(f"model load + 1-token warm-up: {time.perf_counter() - t0:.2f} s; "
              f"chunk size {llm.chunk_size or 'all'} (what `run` uses for this entry)")

        t0 = time.perf_counter()
        prompts = method.build_prompts(task, None)
        t_hash = method.template_hash(task)
        render_s = time.perf_counter() - t0

        clear_state_cache(engine)
        t0 = time.perf_counter()
        single = [engine.generate([p], params)[0] for p in prompts]
        single_s = time.perf_counter() - t0
        single_toks = sum(g.completion_tokens for g in single)

        clear_state_cache(engine)
        t0 = time.perf_counter()
        gens = llm.generate(prompts, params, template_hash=t_hash)
        batched_s = time.perf_counter() - t0
        s = llm.stats
        toks = sum(g.completion_tokens for g in gens)
        t0 = time.perf_counter()
        again = llm.generate(prompts, params, template_hash=t_hash)
        hit_s = time.perf_counter() - t0
        if not all(g.cached for g in again):
            raise RuntimeError("second call should be all cache hits")

        overhead = s.overhead_time_s + render_s
        print(f"\nbatched, shipped path ({s.backend_calls} backend calls): {args.n / batched_s:8.2f} generations/s  "
              f"{toks / batched_s:8.1f} completion tokens/s  ({batched_s:.2f} s, {toks} tokens)")
        print(f"one at a time, in-process:            {args.n / single_s:8.2f} generations/s  "
              f"{single_toks / single_s:8.1f} completion tokens/s  ({single_s:.2f} s, {single_toks} tokens)")
        print(f"cache hits (same call again):         {args.n / hit_s:8.0f} generations/s  ({hit_s * 1000:.1f} ms)")
        print(f"framework overhead, cold call: {overhead * 1000:.1f} ms = {overhead / args.n * 1000:.2f} ms/generation "
              f"= {overhead / s.model_time_s:.4f} of model time ({100 * overhead / s.model_time_s:.2f}%; "
              f"render {render_s * 1000:.1f} ms, cache+parse {s.overhead_time_s * 1000:.1f} ms; target < 2%)")

        cold, hit = overhead_at_scale(tmp)
        per_gen_model = s.model_time_s / args.n
        print(f"overhead at 876 prompts (zero-cost backend): {cold * 1000:.3f} ms/generation cold "
              f"(render+key+lookup+write+parse), {hit * 1000:.3f} ms/generation on hits; "
              f"= {100 * cold / per_gen_model:.3f}% of this model's {per_gen_model:.2f} s/generation")

        if not args.skip_http:
            http_s, http_toks = http_one_at_a_time(spec, prompts, params)
            print(f"one at a time, HTTP (llama_cpp.server): {args.n / http_s:8.2f} generations/s  "
                  f"{http_toks / http_s:8.1f} completion tokens/s  ({http_s:.2f} s, {http_toks} tokens)")
            print(f"batched / one-at-a-time HTTP: {http_s / batched_s:.2f}x generations/s, "
                  f"{(toks / batched_s) / (http_toks / http_s):.2f}x completion tokens/s")
        print(f"batched / one-at-a-time in-process: {single_s / batched_s:.2f}x generations/s, "
              f"{(toks / batched_s) / (single_toks / single_s):.2f}x completion tokens/s")


if __name__ == "__main__":
    main()
