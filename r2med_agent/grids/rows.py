"""One grid row as a Ray task: what ships to a worker, what comes back, and the worker's side.

A row ships as its pure run spec (``RunSpec.key()``) plus the run options (:class:`RowJob`),
resolved in the worker by :func:`resolve_row`, the one place to switch to a resolved plan. The
worker computes in a scratch folder of its own node: its generation cache (seeded with the
generations the driver has and those of the row it depends on), its result tree and its
embedding cache live there; task data, hub snapshots and the authors' prompts are read from the
node's own cache. It returns everything it made (:class:`RowOutput`); only the driver writes the
result tree and the caches. A row killed mid-run and retried on the same node finds the
generations its first attempt committed in the same scratch folder (keyed by the row and the
grid run), so at most the requests in flight are sent again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from r2med_agent.llm.cache.records import CacheRecord, Use

SHARED_CACHES = ("hub", "tasks", "reference-prompts")
"""Folders of the node's cache directory a worker reads in place (downloads and fetched prompts,
written atomically by whoever fetches them first); every other cache is the row's own."""


@dataclass(frozen=True)
class RowOptions:
    """The run options of a row, as the driver was given them.

    Attributes:
        output_dir: the result tree's root as given (relative to the driver's folder; result
            files record it, so the worker runs with the same string inside its scratch folder).
        data_dir: the data folder as given (None: the hub).
        data_root: where a relative ``data_dir`` is (absolute; the same path on every node).
        user_config: the text of the user config file (its LLM, encoder and reranker entries).
    """

    output_dir: str = "results"
    data_dir: str | None = None
    data_root: str | None = None
    allow_count_mismatch: bool = False
    candidates: str | None = None
    user_config: str | None = None


@dataclass(frozen=True)
class Resources:
    """What a row asks Ray for."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int = 0

    def ray_options(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            out["memory"] = self.memory
        return out

    def line(self) -> str:
        mem = f", {self.memory / 2**30:.0f} GiB memory" if self.memory else ""
        return f"{self.num_gpus:g} GPU(s), {self.num_cpus:g} CPU(s){mem}"


@dataclass(frozen=True)
class RowJob:
    """One pending grid row: its spec, tasks and options, what it asks for, and its stages
    (:mod:`~r2med_agent.grids.schedule`): ``stages`` every generation or embedding stage it takes
    part in, ``reads`` those of them another row makes, ``after`` the indexes of those rows."""

    index: int
    label: str
    spec_key: str
    tasks: tuple[str, ...]
    options: RowOptions
    resources: Resources = field(default_factory=Resources)
    stages: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    after: tuple[int, ...] = ()


@dataclass
class RowOutput:
    """What a finished row sends back: its result files (path under the result tree -> bytes),
    the generations and uses it made, the files of the embedding folders it made (path under
    the embedding cache -> bytes; never those it was seeded with), and where it ran."""

    index: int
    files: dict[str, bytes]
    records: list[CacheRecord]
    uses: list[Use]
    embeddings: dict[str, bytes]
    node: str
    seconds: float


def resolve_row(job: RowJob):  # -> RunConfig (imported lazily: workers import it on demand)
    """The runner's configuration of ``job``, built from its run spec and options: the one
    function to switch when the resolved plan ships instead of the spec. The configuration must
    give back the spec it was built from (else the row would make another run's results)."""
    from r2med_agent.errors import ConfigError
    from r2med_agent.experiment.runner import RunConfig
    from r2med_agent.experiment.spec import RunSpec

    spec = RunSpec.from_key(job.spec_key)
    given = {f.name: getattr(spec, f.name) for f in fields(RunSpec)}
    opts = job.options
    if opts.candidates is not None:
        given.pop("candidates")
    cfg = RunConfig(**given, tasks=job.tasks, output_dir=Path(opts.output_dir),
                    data_dir=Path(opts.data_dir) if opts.data_dir else None,
                    allow_count_mismatch=opts.allow_count_mismatch,
                    candidates_path=Path(opts.candidates) if opts.candidates else None, show_progress=False)
    if cfg.spec().key() != job.spec_key:
        raise ConfigError(f"{job.label}: the worker resolved another run spec ({cfg.spec().label})")
    return cfg


def scratch_dir(job: RowJob, run: str = "") -> Path:
    """The row's scratch folder on this node for the grid run ``run`` (the driver's Ray job):
    the same for a retry of the row, another for the next run (which starts from the driver's
    caches, never from what a cancelled run left behind)."""
    digest = hashlib.sha256(f"{job.spec_key}\n{','.join(job.tasks)}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"r2med-ray-{os.getuid()}" / f"{digest}-{run or 'local'}"


def run_row(job: RowJob, seed: Sequence[CacheRecord], *stages: RowOutput) -> RowOutput:
    """Run one row in its scratch folder (the Ray task's body), seeded with the generations and
    embeddings of the rows that made its stages (``stages``), and return what it made."""
    from r2med_agent.experiment.runner import run_experiment
    from r2med_agent.llm import default_cache_path
    from r2med_agent.llm.cache.store import GenerationCache

    import ray

    start = time.monotonic()
    scratch = scratch_dir(job, ray.get_runtime_context().get_job_id())
    with _in_scratch(scratch, job.options):
        shutil.rmtree(Path(job.options.output_dir), ignore_errors=True)  # a killed attempt's files
        seeded = [*seed, *(r for s in stages for r in s.records)]
        with GenerationCache(default_cache_path()) as cache:
            have = set(cache.get_many(r.key for r in seeded))
            cache.put_many(r for r in seeded if r.key not in have)
        given = _seed_embeddings(scratch / "cache" / "embeddings", stages)
        run_experiment(resolve_row(job))
        known = {r.key for r in seeded}
        with GenerationCache(default_cache_path()) as cache:
            records = [r for r in cache.iter_records() if r.key not in known]
            uses = [u for u, _ in cache.uses()]
        files = _read_tree(Path(job.options.output_dir))
        embeddings = {rel: data for rel, data in _read_tree(scratch / "cache" / "embeddings").items()
                      if rel.split("/", 1)[0] not in given}
    shutil.rmtree(scratch, ignore_errors=True)
    return RowOutput(job.index, files, records, uses, embeddings, socket.gethostname(),
                     time.monotonic() - start)


def _seed_embeddings(root: Path, stages: Sequence[RowOutput]) -> set[str]:
    """Write the embedding folders the stage rows made under ``root`` (the row's embedding
    cache), where missing; returns the names of the folders the row was given."""
    from r2med_agent.io import atomic_write_bytes

    given: set[str] = set()
    for out in stages:
        for rel, data in out.embeddings.items():
            folder = rel.split("/", 1)[0]
            given.add(folder)
            if not (root / rel).exists():
                atomic_write_bytes(root / rel, data)
    return given


def _read_tree(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def _in_scratch(scratch: Path, opts: RowOptions) -> Iterator[None]:
    """Work in ``scratch``: the current folder (so the result tree's root is recorded as given),
    ``R2MED_CACHE_DIR`` and the user config; the node's shared caches and a relative data folder
    linked in. Everything is put back after, also on an error."""
    from r2med_agent import config
    from r2med_agent.paths import cache_dir

    node_cache = cache_dir()
    cache = scratch / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    for name in SHARED_CACHES:
        link = cache / name
        (node_cache / name).mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(node_cache / name, target_is_directory=True)
    if opts.data_dir and opts.data_root and not Path(opts.data_dir).is_absolute():
        link = scratch / opts.data_dir
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(opts.data_root, target_is_directory=True)
    user = None
    if opts.user_config is not None:
        user = scratch / "config.yaml"
        user.write_text(opts.user_config, encoding="utf-8")
    before = (os.getcwd(), os.environ.get("R2MED_CACHE_DIR"), config.user_config_path())
    os.chdir(scratch)
    os.environ["R2MED_CACHE_DIR"] = str(cache)
    config.set_user_config(user)
    try:
        yield
    finally:
        os.chdir(before[0])
        if before[1] is None:
            os.environ.pop("R2MED_CACHE_DIR", None)
        else:
            os.environ["R2MED_CACHE_DIR"] = before[1]
        config.set_user_config(before[2])
