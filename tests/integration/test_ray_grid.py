"""``reproduce --ray`` on a real two-node Ray cluster on this machine (``-m ray``): a small grid
whose HyDE rows share one LLM's generations (an OpenAI-compatible server on loopback) gives the
sequential run's files byte for byte and its request count; a worker SIGKILLed mid-row is
retried and the grid completes; Ctrl-C cancels the grid's tasks and the cluster runs the next
grid; a driver killed and run again resumes from the caches."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'r2med-agent[ray]')")

from tests.interrupts import sigint_default  # noqa: E402
from tests.llm_server import CannedChatServer  # noqa: E402
from tests.ray_cluster import RayCluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GRID = """title: shared generations
entries:
  - {method: hyde, llm: canned, retriever: bm25, args: {prompts_from: own}}
  - {method: hyde, llm: canned, retriever: bm25-compat, args: {prompts_from: own}}
  - {method: none, retriever: bm25}
"""
MAKER = "hyde/canned/bm25__*/sample.json"  # the row that makes the stage


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Ray's socket paths must stay under 107 bytes: a short folder in the system's temp dir.
    root = Path(tempfile.mkdtemp(prefix="r2ray"))
    c = RayCluster(root, logs=tmp_path_factory.mktemp("raylogs"))
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    """One server for the module: its URL is part of the user config, so of every run's identity."""
    with CannedChatServer() as s:
        yield s


def _setup(tmp: Path, url: str) -> dict[str, str]:
    (tmp / "grid.yaml").write_text(GRID, encoding="utf-8")
    (tmp / "config.yaml").write_text(
        f"llms:\n  canned:\n    backend: openai\n    model: m\n    server: openai\n    base_urls: [{url}]\n"
        "    max_concurrency: 1\n    chunk_size: 1\n    max_retries: 1\n", encoding="utf-8")
    return {**os.environ, "R2MED_CONFIG": str(tmp / "config.yaml"), "R2MED_CACHE_DIR": str(tmp / "cache")}


def _reproduce(tmp: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "r2med_agent", "reproduce", "--grid", "grid.yaml", "--tasks", "sample",
            "--output-dir", "results", "--format", "csv", *extra]
    return subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_default)  # Ctrl-C reaches it however the suite was started


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


CLOCK = ("evaluated_at", "evaluation_time")
"""The fields of a result file that say when it was made; with every number in seconds (keys
ending ``_s``: durations) they differ between two sequential runs too. Every other byte of every
file is compared."""


WORK = ("generations", "cache_hits", "backend_calls", "prompt_tokens", "completion_tokens")
"""A run's own work counts: a row killed and run again reads from its cache what it had made."""


def _tree(root: Path, drop: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root``, result files without their clock readings (and ``drop``)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.suffix == ".json" and b"evaluated_at" in data:
                data = json.dumps(_without_clock(json.loads(data), drop), indent=1).encode()
            out[p.relative_to(root).as_posix()] = data
    return out


def _without_clock(value, drop=()):
    if isinstance(value, dict):
        return {k: _without_clock(v, drop) for k, v in value.items()
                if k not in CLOCK + drop and not (k.endswith("_s") and isinstance(v, (int, float)))}
    return value


@pytest.fixture(scope="module")
def sequential(server, tmp_path_factory):
    """The grid run one row after another in one process: its result tree's root and request count."""
    tmp = tmp_path_factory.mktemp("sequential")
    before = len(server.requests)
    _finish(_reproduce(tmp, _setup(tmp, server.base_url)))
    return tmp / "results", len(server.requests) - before


def test_grid_on_two_nodes_matches_the_sequential_run(cluster, sequential, server, tmp_path):
    seq, requests = sequential
    tree = _tree(seq)
    assert requests == 12 and len(tree) >= 6  # 12 sample queries, one generation each; 3 rows' files
    env = _setup(tmp_path, server.base_url)
    before = len(server.requests)
    out = _finish(_reproduce(tmp_path, env, "--ray", cluster.address))
    assert _tree(tmp_path / "results") == tree
    assert len(server.requests) - before == requests  # the stage was made once, the bm25-compat row read it
    assert "grid: 3 done, 0 running" in out
    # Run again: every row is done, nothing is sent.
    _finish(_reproduce(tmp_path, env, "--ray", cluster.address))
    assert len(server.requests) - before == requests


ENCODER_GRID = """title: shared embeddings
entries:
  - {method: none, retriever: minilm}
  - {method: none, retriever: bm25+minilm}
"""


def test_rows_of_one_encoder_encode_the_corpus_once_on_the_cluster(cluster, server, tmp_path):
    """Two rows of the MiniLM encoder: the corpus is encoded once, by the first; the second runs
    after it, seeded with its embeddings; the files are the sequential run's."""
    runs = {}
    for name, extra in (("sequential", ()), ("ray", ("--ray", cluster.address))):
        tmp = tmp_path / name
        tmp.mkdir()
        env = _setup(tmp, server.base_url)
        (tmp / "grid.yaml").write_text(ENCODER_GRID, encoding="utf-8")
        runs[name] = tmp, _finish(_reproduce(tmp, env, *extra), timeout=400)
    (seq, _), (tmp, out) = runs["sequential"], runs["ray"]
    folders = sorted(p.name for p in (seq / "cache" / "embeddings").iterdir())
    assert len(folders) == 1  # the sequential run's encoder passes: one corpus, one encoder
    assert sorted(p.name for p in (tmp / "cache" / "embeddings").iterdir()) == folders
    encoded = [int(n) for n in re.findall(r"(\d+) corpus embedding\(s\) encoded", out)]
    assert sorted(encoded) == [0, 1], out  # two rows, one encoder pass in the cluster
    assert "grid: 2 done, 0 running" in out
    assert _tree(tmp / "results") == _tree(seq / "results")
    npy = f"{folders[0]}/embeddings.npy"
    assert (tmp / "cache" / "embeddings" / npy).read_bytes() == (seq / "cache" / "embeddings" / npy).read_bytes()


def test_dry_run_prints_the_schedule_on_the_cluster(cluster, server, tmp_path):
    out = _finish(_reproduce(tmp_path, _setup(tmp_path, server.base_url), "--ray", cluster.address, "--dry-run"))
    assert "schedule on 0 GPU(s) of 80 GiB (3 row(s) to run):" in out
    assert "[1] hyde/canned/bm25-compat: 0 GPU(s), 1 CPU(s), 2 GiB memory; " in out
    assert "reads the stage of [0]" in out and "stages: 1 generation stage(s) made once, 1 row(s) wait" in out


def test_a_worker_killed_mid_row_is_retried(cluster, sequential, server, tmp_path):
    seq, requests = sequential
    before = len(server.requests)
    server.delay_s = 0.4
    try:
        proc = _reproduce(tmp_path, _setup(tmp_path, server.base_url), "--ray", cluster.address)
        killed = _kill_row_worker_after(cluster, server, before + 4)
        _finish(proc)
    finally:
        server.delay_s = 0.0
    assert killed
    assert _tree(tmp_path / "results", WORK) == _tree(seq, WORK)
    stats = json.loads(next((tmp_path / "results").glob(MAKER)).read_text())["stats"]
    assert stats["generations"] + stats["cache_hits"] == requests and stats["cache_hits"] >= 3
    # The generations committed before the kill were kept: only the request in flight is sent again.
    assert requests <= len(server.requests) - before <= requests + 1


def test_ctrl_c_cancels_the_grids_tasks_and_leaves_the_cluster_usable(cluster, server, tmp_path):
    before = len(server.requests)
    server.delay_s = 1.0
    try:
        proc = _reproduce(tmp_path, _setup(tmp_path, server.base_url), "--ray", cluster.address)
        deadline = time.monotonic() + 180
        while len(server.requests) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # one Ctrl-C
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, out
        deadline = time.monotonic() + 30
        while cluster.row_workers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cluster.row_workers() == []  # the row's task was cancelled, its worker ended
        sent = len(server.requests)
        time.sleep(2)
        assert len(server.requests) == sent < before + 12  # nothing more is asked
    finally:
        server.delay_s = 0.0
    assert not list((tmp_path / "results").glob(MAKER))  # no partial result
    # The next test runs a whole grid on the same cluster.


def test_a_driver_killed_and_run_again_resumes_from_the_caches(cluster, sequential, server, tmp_path):
    seq, requests = sequential
    before = len(server.requests)
    env = _setup(tmp_path, server.base_url)
    proc = _reproduce(tmp_path, env, "--ray", cluster.address)
    deadline = time.monotonic() + 180
    while not list((tmp_path / "results").glob(MAKER)) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert list((tmp_path / "results").glob(MAKER))
    assert len(server.requests) - before == requests
    _finish(_reproduce(tmp_path, env, "--ray", cluster.address))
    assert _tree(tmp_path / "results") == _tree(seq)
    assert len(server.requests) - before == requests  # the stage's generations came from the driver's cache


def _kill_row_worker_after(cluster: RayCluster, server: CannedChatServer, n: int) -> bool:
    """SIGKILL the worker running a grid row once the server has had ``n`` requests."""
    deadline = time.monotonic() + 180
    while len(server.requests) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in cluster.row_workers():
        if len(server.requests) < n + 8:
            os.kill(pid, signal.SIGKILL)
            return True
    return False
