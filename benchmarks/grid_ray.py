"""Grids on a Ray cluster (issue 37): the small grid's makespan on two local Ray nodes against
the sequential run, and, from the planner, the frontier grid packed onto 8 GPUs of 80 GB.

    python benchmarks/grid_ray.py [--delay 0.3] [--skip-cluster]

Part 1 runs a four-row grid on the packaged ``sample`` task (12 queries): two HyDE rows that share
one LLM's generations (an OpenAI-compatible server on 127.0.0.1 that answers each request after
``--delay`` seconds, one at a time, standing in for model time), and two plain BM25 rows; first
sequentially (``reproduce``), then with ``reproduce --ray`` on a two-node cluster started here
(2 + 1 CPUs), each from empty caches. Both wall times include the CLI's start; the Ray run's
excludes the cluster's start. Part 2 packs the frontier grid's rows onto 8 GPUs from the
``--dry-run`` estimates (list scheduling, as the cluster fills; each encoder's corpus embeddings
counted once, in the first row of that encoder, the others after it) and prints the makespan, the idle
GPU share and the longest chain of dependent rows beside the sequential sum.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = """title: shared generations
entries:
  - {method: hyde, llm: canned, retriever: bm25, args: {prompts_from: own}}
  - {method: hyde, llm: canned, retriever: bm25-compat, args: {prompts_from: own}}
  - {method: none, retriever: bm25}
  - {method: none, retriever: bm25-compat}
"""


def _run(folder: Path, url: str, *extra: str) -> float:
    folder.mkdir(parents=True)
    (folder / "grid.yaml").write_text(GRID, encoding="utf-8")
    (folder / "config.yaml").write_text(
        f"llms:\n  canned:\n    backend: openai\n    model: m\n    server: openai\n    base_urls: [{url}]\n"
        "    max_concurrency: 1\n", encoding="utf-8")
    env = {**os.environ, "R2MED_CONFIG": str(folder / "config.yaml"), "R2MED_CACHE_DIR": str(folder / "cache")}
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "r2med_agent", "reproduce", "--grid", "grid.yaml", "--tasks", "sample",
                    "-o", "results", "--format", "csv", *extra], cwd=folder, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - start


def small_grid(delay: float) -> None:
    from tests.llm_server import CannedChatServer
    from tests.ray_cluster import RayCluster

    work = Path(tempfile.mkdtemp(prefix="r2grid"))
    try:
        with CannedChatServer(delay_s=delay) as server:
            seq = _run(work / "sequential", server.base_url)
            seq_requests = len(server.requests)
            cluster = RayCluster(work / "ray", logs=work)
            try:
                on_ray = _run(work / "on-ray", server.base_url, "--ray", cluster.address)
            finally:
                cluster.stop()
            ray_requests = len(server.requests) - seq_requests
        print(f"small grid (4 rows, sample task, {delay:g} s per LLM request): sequential {seq:.1f} s, "
              f"two local Ray nodes {on_ray:.1f} s ({seq / on_ray:.2f}x); LLM requests {seq_requests} vs {ray_requests}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def frontier(gpus: int = 8, gpu_gib: float = 80.0) -> None:
    from r2med_agent.grids.cluster import build_jobs, job_graph
    from r2med_agent.grids.schedule import idle_share, longest_chain, pack
    from r2med_agent.api import ReproduceOptions, load_grid, plan

    grid = load_grid("frontier")
    opts = ReproduceOptions(output_dir=Path("results"), tasks=grid.tasks, gpu_gib=gpu_gib)
    planned = plan(grid, opts)
    jobs = build_jobs(planned, opts)
    hours, row_gpus, after = job_graph(planned, jobs)  # a corpus's encoding counted once, in its first row
    slots = pack(hours, row_gpus, after, gpus)
    makespan = max(s.end for s in slots)
    chain = longest_chain(hours, after)
    gpu_hours = sum(h * max(j.resources.num_gpus, 1) for h, j in zip(hours, jobs))
    print(f"frontier grid ({len(jobs)} rows) on {gpus} GPUs of {gpu_gib:g} GB: estimated makespan {makespan:,.0f} h, "
          f"idle GPU share {idle_share(slots, gpus):.0%}; longest chain of dependent rows {chain:,.0f} h "
          f"(makespan {makespan / chain:.2f}x it; target <= 1.2x); sequential sum {sum(hours):,.0f} h "
          f"({sum(hours) / makespan:.1f}x the makespan; {gpu_hours:,.0f} GPU-hours)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay", type=float, default=0.3, help="seconds the loopback server takes per request")
    ap.add_argument("--skip-cluster", action="store_true", help="only the frontier packing (no Ray cluster)")
    args = ap.parse_args()
    frontier()
    if not args.skip_cluster:
        small_grid(args.delay)


if __name__ == "__main__":
    main()
