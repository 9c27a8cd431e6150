"""The Slurm script of docs/reproduce.md (``docs/slurm/ray-grid.sbatch``, included there verbatim)
run as Slurm would run it, on loopback: ``scontrol`` and ``srun`` are stubs that name two nodes
and run each node's command on this machine (``ray start`` with ports of its own, as two nodes on
one machine need); the script starts a real Ray head and worker and runs a small grid on them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'r2med-agent[ray]')")

from tests.llm_server import free_port  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "slurm" / "ray-grid.sbatch"

SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" && "$3" == "node[1-2]" ]] || { echo "stub scontrol: $*" >&2; exit 2; }
printf '%s\\n' node1 node2
"""

SRUN = """#!/bin/bash
# srun --nodes=1 --ntasks=1 -w NODE CMD...: CMD on this machine; `ray start` with ports of its own.
while [[ $# -gt 0 && $1 == -* ]]; do case $1 in -w) shift 2;; *) shift;; esac; done
if [[ "$1 $2" == "ray start" ]]; then
  own=$(python -c 'import socket
for a in ("node-manager", "object-manager", "runtime-env-agent", "metrics-export", "dashboard-agent-listen",
          "dashboard-agent-grpc"):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); print(f"--{a}-port={s.getsockname()[1]}"); s.close()')
  head=""
  [[ " $* " == *" --head "* ]] && head="--include-dashboard=false --temp-dir=$STUB_RAY_TEMP"
  exec "$@" $own $head --object-store-memory=83886080 --disable-usage-stats
fi
exec "$@"
"""

GRID = """title: on slurm
entries:
  - {method: none, retriever: bm25}
  - {method: none, retriever: bm25-compat}
"""


def test_the_docs_sbatch_script_starts_a_head_and_a_worker_and_runs_a_grid(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text, encoding="utf-8")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "grid.yaml").write_text(GRID, encoding="utf-8")
    temp = Path(tempfile.mkdtemp(prefix="r2slurm"))  # Ray's socket paths must stay short
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "1", "R2MED_RAY_PORT": str(free_port()),
           "STUB_RAY_TEMP": str(temp), "R2MED_CACHE_DIR": str(tmp_path / "cache"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "job.out"  # a file: the nodes the script leaves running keep its output open
    with log.open("wb") as f:
        proc = subprocess.Popen(["bash", str(SCRIPT), "--grid", "grid.yaml", "--tasks", "sample", "-o", "results",
                                 "--format", "csv"], cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=300)
        out = log.read_text(errors="replace")
        assert proc.returncode == 0, out
        nodes = subprocess.run(
            [sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(sorted(n['Resources'].get('CPU') for n in ray.nodes() if n['Alive']))",
             f"{_node_ip()}:{env['R2MED_RAY_PORT']}"], env=env, capture_output=True, text=True, timeout=120)
    finally:
        _stop(proc, temp)
    assert nodes.stdout.strip().splitlines()[-1] == "[1.0, 1.0]", nodes.stderr  # the head and the worker
    assert "grid: 2 done, 0 running" in out, out
    assert len(list((tmp_path / "results").rglob("sample.json"))) == 2


def _node_ip() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())


def _stop(proc: subprocess.Popen[bytes], temp: Path) -> None:
    """End the script's process group (its `ray start --block` nodes stop on SIGTERM), then any
    process still naming this test's Ray folder."""
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(temp) in part for part in p.info["cmdline"] or ()):
            try:
                p.kill()
            except psutil.Error:
                pass
    shutil.rmtree(temp, ignore_errors=True)
