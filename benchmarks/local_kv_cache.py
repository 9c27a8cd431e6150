"""llama.cpp in-process backend: interleaved trajectories with and without the state cache.

The reasoning-search loops generate, at every step, for all unfinished trajectories one after
another; each trajectory's next request is its previous prompt plus what it generated plus the
inserted documents, continued as an open assistant message. llama.cpp keeps the KV cache of one
sequence, so without help each request shares only the system/instruction prefix with the one
before it (another trajectory's) and is evaluated almost in full.
``r2med_agent.llm.local.KV_CACHE_BYTES`` gives each loaded model a cache of llama.cpp states
(``LlamaRAMCache``, lean states, see ``_state_cache``), which restores the trajectory's own last
state so only its new text is evaluated.

This script runs the same interleaved schedule (trajectories A, B, ... at step 1, then A, B, ...
at step 2, ...) on SmolLM2-135M (registry entry ``smollm2``) with the cache off and on, and
prints the prompt tokens llama.cpp evaluated, its prompt-evaluation time (``llama_perf_context``),
the wall time, the cache's size and the process's resident memory. Greedy decoding; the generated
text may differ between the two runs in a few places because a tiny quantised model's greedy
choice can flip with how the prompt was split into evaluation batches.

Usage::

    python benchmarks/local_kv_cache.py [--trajectories 2] [--steps 4] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from r2med_agent.llm import local
from r2med_agent.llm.registry import get_llm_spec, make_backend
from r2med_agent.types import SamplingParams

DOC = (
    "Hypertension is a chronic condition in which the blood pressure in the arteries is "
    "persistently elevated. Long-term high blood pressure is a major risk factor for stroke, "
    "coronary artery disease, heart failure, atrial fibrillation and chronic kidney disease. "
) * 4
SYMPTOMS = ["fatigue", "headache", "dizziness", "nausea", "fever", "cough"]


def rss_mib() -> float:
    """Resident memory of this process now (Linux), in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(cache_bytes: int, trajectories: int, steps: int, max_tokens: int) -> dict[str, Any]:
    import llama_cpp

    local._MODELS.clear()  # load afresh with this cache setting
    local.KV_CACHE_BYTES = cache_bytes
    backend = make_backend(get_llm_spec("smollm2"))
    model = backend._model().llama
    rss_before = rss_mib()
    questions = [
        f"Question {i}: which treatments are recommended for patient case {i} with "
        f"{', '.join(SYMPTOMS[: 1 + i % len(SYMPTOMS)])}?"
        for i in range(trajectories)
    ]
    texts = [""] * trajectories
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    evaluated = prompt_tokens = 0
    prompt_ms = wall = 0.0
    outputs: list[str] = []
    for _step in range(steps):
        for i in range(trajectories):
            messages = [{"role": "user", "content": questions[i]}]
            if texts[i]:
                messages.append({"role": "assistant", "content": texts[i]})
            llama_cpp.llama_perf_context_reset(model.ctx)
            start = time.perf_counter()
            gen = backend.generate([messages], params)[0]
            wall += time.perf_counter() - start
            perf = llama_cpp.llama_perf_context(model.ctx)
            evaluated += perf.n_p_eval
            prompt_ms += perf.t_p_eval_ms
            prompt_tokens += gen.prompt_tokens
            outputs.append(gen.text)
            texts[i] += gen.text + f"\n<information>{DOC}</information>\n"
    cache = model.cache
    return {
        "prompt_tokens": prompt_tokens,
        "evaluated": evaluated,
        "prompt_ms": prompt_ms,
        "wall_s": wall,
        "entries": len(cache.cache_state) if cache is not None else 0,
        "cache_mib": cache.cache_size / 2**20 if cache is not None else 0.0,
        "rss_growth_mib": rss_mib() - rss_before,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    default = local.KV_CACHE_BYTES
    results = {
        "off": run(0, args.trajectories, args.steps, args.max_tokens),
        "on": run(default, args.trajectories, args.steps, args.max_tokens),
    }
    local.KV_CACHE_BYTES = default
    print(
        f"{args.trajectories} trajectories x {args.steps} steps, {args.max_tokens} new tokens "
        f"per step (SmolLM2-135M, llama.cpp, CPU)"
    )
    print(
        f"{'state cache':<12}{'prompt tok':>11}{'evaluated':>10}{'prompt-eval ms':>15}"
        f"{'wall s':>8}{'entries':>8}{'cache MiB':>10}{'RSS +MiB':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:<12}{r['prompt_tokens']:>11}{r['evaluated']:>10}{r['prompt_ms']:>15.0f}"
            f"{r['wall_s']:>8.2f}{r['entries']:>8}{r['cache_mib']:>10.1f}"
            f"{r['rss_growth_mib']:>9.0f}"
        )
    same = sum(a == b for a, b in zip(results["off"]["outputs"], results["on"]["outputs"]))
    print(f"identical generations: {same} of {len(results['off']['outputs'])}")


if __name__ == "__main__":
    main()
