"""``reproduce --ray``: a grid's pending rows as Ray tasks, one writer, the same files.

The driver plans the grid as ``reproduce`` does, turns each pending row into a :class:`RowJob`
(its run spec, tasks, options, resource request and the rows whose generation or embedding
stages it reads), and submits them all: a row that reads another's stage gets that row's output
as an argument, so Ray starts it only when the stage is made, and it finds every text in its
generation cache and every corpus embedding in its embedding cache (the counts of LLM requests
and encoder passes are a sequential run's). Rows run side by side where the cluster's
GPUs and CPUs allow. Every finished row's generations, embeddings and result files come back to
the driver, which alone writes the caches and then the result tree, atomically, as a sequential
run does: a driver killed and run again skips the rows whose results exist and reads the
generations the finished rows made. A worker killed mid-row is retried by Ray
(:data:`MAX_RETRIES`); Ctrl-C cancels this grid's tasks and leaves the cluster running.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError
from r2med_agent.grids.rows import Resources, RowJob, RowOptions, RowOutput, run_row
from r2med_agent.grids.schedule import (
    CPU_ROW_MEMORY,
    embedding_stage,
    embedding_stages,
    idle_share,
    is_embedding,
    longest_chain,
    pack,
    row_resources,
    stage_key,
)

logger = logging.getLogger(__name__)

MAX_RETRIES = 3
"""Times Ray runs a row again after its worker or node died (Ray's own default for tasks)."""


def ray_address(given: str) -> str | None:
    """``ray.init``'s address for ``--ray``: ``local`` starts a cluster on this machine, ``auto``
    (or ``RAY_ADDRESS`` when given ``env``) joins the running one, else the address as given."""
    if given == "env":
        env = os.environ.get("RAY_ADDRESS")
        if not env:
            raise ConfigError("--ray env: RAY_ADDRESS is not set")
        return env
    return given


def build_jobs(planned: Sequence[Any], opts: Any) -> list[RowJob]:
    """The pending rows of a plan as jobs, each with its resources and stage producer."""
    from r2med_agent.config import user_config_path
    from r2med_agent.experiment.spec import RunSpec
    from r2med_agent.methods.base import capabilities

    user = user_config_path()
    options = RowOptions(
        output_dir=str(opts.output_dir), data_dir=str(opts.data_dir) if opts.data_dir else None,
        data_root=str(Path(opts.data_dir).resolve()) if opts.data_dir else None,
        allow_count_mismatch=opts.allow_count_mismatch,
        candidates=str(Path(opts.candidates).resolve()) if opts.candidates else None,
        user_config=user.read_text(encoding="utf-8") if user is not None and user.exists() else None,
    )
    jobs: list[RowJob] = []
    makers: dict[str, int] = {}
    for i, p in enumerate(planned):
        if not p.pending:
            continue
        spec = RunSpec.from_key(p.spec_key)
        generation = stage_key(spec, capabilities(p.plan.method).agentic)
        stages = ([generation] if generation is not None else []) + embedding_stages(p.plan, p.pending)
        reads = tuple(s for s in stages if s in makers)
        makers.update((s, i) for s in stages if s not in makers)
        jobs.append(RowJob(i, p.entry.label, p.spec_key, p.pending, options, row_resources(p.plan),
                           tuple(stages), reads, tuple(sorted({makers[s] for s in reads}))))
    return jobs


def row_hours(p: Any, gpus: float, reads: Sequence[str] = ()) -> float:
    """Estimated wall hours of a planned row: its LLM and encoding GPU-hours over its GPUs, less
    the document encoding of the embedding stages it ``reads`` (another row makes them)."""
    est = sum(e.gpu_hours or 0.0 for e in p.needs.estimates)
    enc = sum((e.query_hours or 0.0) + (0.0 if _reads_all(e, reads) else e.doc_hours or 0.0)
              for e in p.needs.encoding)
    return (est + enc) / max(gpus, 1.0)


def _reads_all(estimate: Any, reads: Sequence[str]) -> bool:
    return bool(estimate.tasks) and all(embedding_stage(estimate.encoder, t) in reads for t in estimate.tasks)


def job_graph(planned: Sequence[Any], jobs: Sequence[RowJob]) -> tuple[list[float], list[int], dict[int, list[int]]]:
    """The jobs for :func:`~r2med_agent.grids.schedule.pack`: hours, GPUs and, by position, the
    positions of the rows each waits for."""
    at = {j.index: n for n, j in enumerate(jobs)}
    hours = [row_hours(planned[j.index], j.resources.num_gpus, j.reads) for j in jobs]
    return hours, [int(j.resources.num_gpus) for j in jobs], {n: [at[a] for a in j.after] for n, j in enumerate(jobs)}


def _stage_words(j: RowJob) -> str:
    made = [s for s in j.stages if s not in j.reads]
    gen = sum(1 for s in made if not is_embedding(s))
    words = (["makes its generation stage"] if gen else []) + (
        [f"makes {len(made) - gen} embedding stage(s)"] if len(made) > gen else [])
    if j.after:
        words.append(f"reads the stage{'s' if len(j.after) > 1 else ''} of [{', '.join(map(str, j.after))}]")
    return "; ".join(words) or "no stage"


def schedule_lines(planned: Sequence[Any], jobs: Sequence[RowJob], total_gpus: int, gpu_gib: float) -> list[str]:
    """``--dry-run --ray``: the stages, each row's request and the estimated makespan on
    ``total_gpus`` GPUs beside the sequential total."""
    from r2med_agent.grids.estimates import format_hours

    hours, gpus, after = job_graph(planned, jobs)
    lines = [f"schedule on {total_gpus} GPU(s) of {gpu_gib:g} GiB ({len(jobs)} row(s) to run):"]
    for n, j in enumerate(jobs):
        lines.append(f"  [{j.index}] {j.label}: {j.resources.line()}; ≈{format_hours(hours[n])} h; {_stage_words(j)}")
    slots = pack(hours, gpus, after, total_gpus)
    too_big = sorted(set(range(len(jobs))) - {s.index for s in slots})
    for n in too_big:
        lines.append(f"  [{jobs[n].index}] {jobs[n].label} needs {gpus[n]} GPUs: more than the cluster has")
    makespan = max((s.end for s in slots), default=0.0)
    made = {s for j in jobs for s in j.stages}
    embeddings = sum(1 for s in made if is_embedding(s))
    lines.append(f"stages: {len(made) - embeddings} generation stage(s) made once, {sum(1 for j in jobs if j.after)} "
                 f"row(s) wait for one; {embeddings} corpus embedding(s) made once")
    lines.append(f"estimated makespan ≈{format_hours(makespan)} h on {total_gpus} GPU(s) "
                 f"(idle GPU share {idle_share(slots, total_gpus):.0%}; longest chain "
                 f"≈{format_hours(longest_chain(hours, after))} h); sequential total ≈{format_hours(sum(hours))} h")
    return lines


def cluster_gpus() -> int:
    """GPUs of the Ray cluster this process is connected to."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def run_grid(planned: Sequence[Any], opts: Any, address: str, log: Callable[[str], None] = logger.info) -> None:
    """Run the pending rows of ``planned`` on the Ray cluster at ``address`` (``reproduce --ray``)."""
    output = Path(opts.output_dir)
    if output.is_absolute():
        raise ConfigError(f"--ray: give --output-dir relative to this folder, not {output} (result files "
                          "record it as given, and workers write theirs in their own scratch folders)")
    run_on_ray(build_jobs(planned, opts), ray_address(address), log)


def run_on_ray(jobs: Sequence[RowJob], address: str | None, log: Callable[[str], None] = logger.info) -> None:
    """Run ``jobs`` on the Ray cluster at ``address`` and write what they make (one writer)."""
    import ray

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        _drive(on_cpus(jobs, log) if cluster_gpus() == 0 else jobs, log)
    finally:
        ray.shutdown()


def on_cpus(jobs: Sequence[RowJob], log: Callable[[str], None]) -> list[RowJob]:
    """``jobs`` for a cluster without GPUs: every row asks for CPUs, as a sequential run on such a
    machine runs its encoders, rerankers and LLMs on the CPU (else Ray would wait for GPUs forever)."""
    moved = [j for j in jobs if j.resources.num_gpus]
    if moved:
        log(f"the cluster has no GPU: {len(moved)} row(s) that ask for GPUs run on CPUs")
    return [dataclasses.replace(j, resources=Resources(num_cpus=1, memory=CPU_ROW_MEMORY)) if j.resources.num_gpus
            else j for j in jobs]


def _drive(jobs: Sequence[RowJob], log: Callable[[str], None]) -> None:
    import ray

    from r2med_agent.llm import default_cache_path
    from r2med_agent.llm.cache.store import GenerationCache

    with GenerationCache(default_cache_path()) as cache:
        seed = ray.put(list(cache.iter_records()))
    task = ray.remote(run_row)
    refs: dict[int, Any] = {}
    for j in jobs:
        deps = [refs[a] for a in j.after]
        refs[j.index] = task.options(**j.resources.ray_options(), max_retries=MAX_RETRIES,
                                     name=f"r2med-row-{j.index}").remote(j, seed, *deps)
    waiting = {ref: j for j, ref in zip(jobs, refs.values())}
    done: set[int] = set()
    try:
        log(_progress(jobs, done, time.monotonic()))
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=30)
            for ref in ready:
                job = waiting.pop(ref)
                out = ray.get(ref)
                write_output(out, Path(job.options.output_dir))
                done.add(job.index)
                log(f"[{job.index}] {job.label} done on {out.node} in {out.seconds:.1f}s "
                    f"({len(out.records)} new generation(s), {len(_folders(out))} corpus embedding(s) encoded)")
            log(_progress(jobs, done, time.monotonic()))
    except BaseException:
        for ref in waiting:
            ray.cancel(ref, force=True)
        raise


def _progress(jobs: Sequence[RowJob], done: set[int], now: float) -> str:
    running = [j for j in jobs if j.index not in done and all(a in done for a in j.after)]
    pending = len(jobs) - len(done) - len(running)
    return (f"grid: {len(done)} done, {len(running)} running or queued for resources, {pending} waiting for a "
            f"stage ({time.strftime('%H:%M:%S')})")


def _folders(out: RowOutput) -> list[str]:
    """The embedding folders (one encoder's embeddings of one corpus each) a row made."""
    return sorted({rel.split("/", 1)[0] for rel in out.embeddings})


def write_output(out: RowOutput, output_dir: Path) -> None:
    """Store a finished row as a sequential run would have: its generations and uses in the
    generation cache, its embedding folders under the cache directory (each whole, where
    missing), then its result files under ``output_dir``, each written atomically."""
    from r2med_agent.llm import default_cache_path
    from r2med_agent.io import atomic_write_bytes
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.paths import cache_dir

    with GenerationCache(default_cache_path()) as cache:
        cache.put_many(out.records, out.uses)
    root = cache_dir() / "embeddings"
    for folder in _folders(out):
        if (root / folder).exists():
            continue
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{folder}.", suffix=".tmp"))
        for rel, data in out.embeddings.items():
            if rel.startswith(f"{folder}/"):
                atomic_write_bytes(tmp / rel.split("/", 1)[1], data)
        try:
            os.replace(tmp, root / folder)
        except OSError:  # another writer was first: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    # The result file (.json) last, after the run files: it is what marks a row done.
    for rel in sorted(out.files, key=lambda r: r.endswith(".json")):
        atomic_write_bytes(output_dir / rel, out.files[rel])



def schedule_text(planned: Sequence[Any], opts: Any, address: str, gpus: int | None = None) -> str:
    """The ``--dry-run --ray`` schedule: on ``gpus`` GPUs when given, else on the GPUs of the
    cluster at ``address`` (joined for the count only)."""
    if gpus is None:
        import ray

        ray.init(address=ray_address(address), logging_level=logging.WARNING, log_to_driver=False)
        try:
            gpus = cluster_gpus()
        finally:
            ray.shutdown()
    return "\n".join(schedule_lines(planned, build_jobs(planned, opts), gpus, opts.gpu_gib))
