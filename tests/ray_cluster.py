"""A real two-node Ray cluster on this machine for tests (``ray start --head`` plus a second
``ray start --address``), every process of it in process groups of its own so that the test ends
exactly these processes and no other Ray cluster on the machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.llm_server import free_port

OBJECT_STORE = str(80 * 2**20)  # bytes; Ray's least is 75 MiB


def node_ip() -> str:
    """The address Ray gives this machine: ``ray.init`` turns 127.0.0.1 into it (the interface of
    the default route, or loopback without one), so the nodes must be started on it too, or a
    client that was given 127.0.0.1 connects elsewhere and finds no cluster."""
    import ray.util

    return str(ray.util.get_node_ip_address())


class RayCluster:
    """``ray start --head --block`` and one worker node, both on 127.0.0.1 with small resources.

    Attributes:
        address: ``host:port`` of the head's GCS, for ``ray.init`` and ``--ray``.
    """

    def __init__(self, root: Path, logs: Path, head_cpus: int = 2, worker_cpus: int = 1) -> None:
        self.root, self.logs = root, logs
        self.port = free_port()
        self.ip = node_ip()
        self.address = f"{self.ip}:{self.port}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start_nodes(head_cpus, worker_cpus)
        except BaseException:
            self.stop()
            raise

    def _start_nodes(self, head_cpus: int, worker_cpus: int) -> None:
        common = ["--block", "--disable-usage-stats", "--object-store-memory", OBJECT_STORE, "--num-gpus", "0",
                  "--node-ip-address", self.ip]
        self._start(["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.root}",
                     f"--num-cpus={head_cpus}", *_ports(), *common], "head")
        self._wait_nodes(1)
        self._start([f"--address={self.address}", f"--num-cpus={worker_cpus}", *_ports(), *common], "worker")
        self._wait_nodes(2)

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.logs / f"ray-{name}.log", "wb")  # noqa: SIM115 (kept open with the process)
        ray = str(Path(sys.executable).with_name("ray"))
        self.procs.append(subprocess.Popen([ray, "start", *args], env=self.env, stdout=log, stderr=log,
                                           start_new_session=True))

    def _wait_nodes(self, n: int, deadline_s: float = 120.0) -> None:
        """Wait until the GCS answers, then until ``n`` nodes are alive (one client, polling)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            self._check_alive()
            try:
                socket.create_connection((self.ip, self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        code = ("import ray,sys,time; ray.init(address=sys.argv[1], logging_level='ERROR')\n"
                "while sum(1 for n in ray.nodes() if n['Alive']) < int(sys.argv[2]): time.sleep(0.5)")
        client = subprocess.Popen([sys.executable, "-c", code, self.address, str(n)], env=self.env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while client.poll() is None and time.monotonic() < end:
            self._check_alive()
            time.sleep(0.5)
        if client.poll() != 0:
            client.kill()
            client.wait()
            raise RuntimeError(f"the Ray cluster at {self.address} has not {n} live node(s) after {deadline_s}s")

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"ray start exited with {p.returncode} (see {self.logs}/ray-*.log)")

    def row_workers(self) -> list[int]:
        """Pids of this cluster's worker processes running a grid row (``ray::r2med-row-N``)."""
        import psutil

        out = []
        for p in self.procs:
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    if any("r2med-row" in part for part in child.cmdline()):
                        out.append(child.pid)
            except psutil.Error:
                continue
        return out

    def stop(self) -> None:
        """End this cluster's processes: SIGTERM to each node's process group (``ray start
        --block`` stops its node), SIGKILL after a grace period, then any process still naming
        this cluster's temp folder (only this cluster's processes do)."""
        import psutil

        for p in reversed(self.procs):
            _signal_group(p, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p, signal.SIGKILL)
            p.wait(timeout=30)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(str(self.root) in part for part in proc.info["cmdline"] or ()):
                try:
                    proc.kill()
                except psutil.Error:
                    pass


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _ports() -> list[str]:
    """Free ports for a node's own servers (two nodes on one machine must not share them)."""
    return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"]
