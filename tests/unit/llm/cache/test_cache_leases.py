"""Leases in the generation cache: runs sharing one cache file never send the same request twice,
and a run killed (SIGKILL) while holding leases leaves nothing lost (real processes)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from r2med_agent.llm.cache.store import CacheRecord, GenerationCache, LeaseOwner, request_key
from r2med_agent.llm.cache.leases import _pid_start, _proc_stat
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.types import Generation, SamplingParams
from tests.fakes import ScriptedLLM

REPO_ROOT = Path(__file__).resolve().parents[4]

WORKER = textwrap.dedent(
    """
    import logging, os, sys, time
    from pathlib import Path
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.types import Generation, SamplingParams
    from tests.fakes import ScriptedLLM

    path, count, delay, go, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    logging.basicConfig(filename=log, level=logging.INFO, format="%(message)s")

    def script(messages, params):
        time.sleep(delay)
        return "gen " + messages[-1]["content"]

    backend = ScriptedLLM(script, "fake-model")
    llm = CachedLLM(backend, "fake-model", "plain", GenerationCache(path, busy_timeout_s=30), chunk_size=None)
    llm.lease_poll_s, llm.lease_note_s = 0.1, 0.2
    prompts = [[{"role": "user", "content": str(i)}] for i in range(count)]
    while not go.exists():  # every worker starts generating at the same moment
        time.sleep(0.01)
    out = llm.generate(prompts, SamplingParams(temperature=0.0))
    assert [g.text for g in out] == ["gen " + str(i) for i in range(count)]
    print(llm.stats.generations, llm.stats.cache_hits, llm.stats.backend_calls, sum(len(c) for c in backend.calls))
    """
)


def spawn(tmp_path: Path, name: str, count: int, delay: float) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "g.sqlite"), str(count), str(delay), str(tmp_path / "go"), str(log)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, log


def finish(proc: subprocess.Popen) -> list[int]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return [int(x) for x in out.split()]


def table_rows(path: Path, table: str) -> int:
    with sqlite3.connect(path) as raw:
        return int(raw.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_three_runs_sharing_a_cache_generate_each_text_once(tmp_path):
    procs = [spawn(tmp_path, f"run{i}", 12, 0.1)[0] for i in range(3)]
    time.sleep(0.1)
    (tmp_path / "go").touch()
    stats = [finish(p) for p in procs]
    generated = [s[0] for s in stats]
    assert sum(generated) == 12  # today each of the three runs generates all 12
    assert sum(s[3] for s in stats) == 12  # requests the backends really received
    assert all(s[0] + s[1] == 12 for s in stats)
    assert all(s[2] <= 1 for s in stats)  # whatever one run generates goes in ONE backend call
    assert table_rows(tmp_path / "g.sqlite", "generations") == 12
    assert table_rows(tmp_path / "g.sqlite", "leases") == 0


def test_leases_of_a_sigkilled_run_are_taken_over(tmp_path):
    path = tmp_path / "g.sqlite"
    (tmp_path / "go").touch()
    # The first run claims all 12 and would take 36 s for its one backend call (it is killed
    # long before, as soon as the others wait).
    killed, _ = spawn(tmp_path, "killed", 12, 3.0)
    wait_for(lambda: path.exists() and _leases(path) == 12, "the first run's leases")
    others = [spawn(tmp_path, f"run{i}", 12, 0.05) for i in range(2)]
    # Both others see every text leased by a live run, and wait instead of generating.
    for _, log in others:
        wait_for(lambda log=log: log.exists() and "waiting for 12 texts" in log.read_text(), "a waiting run")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert _leases(path) == 12  # it died holding them

    stats = [finish(p) for p, _ in others]
    assert sum(s[0] for s in stats) == 12  # the texts the dead run never wrote, each made once
    assert all(s[0] + s[1] == 12 for s in stats)
    assert table_rows(path, "generations") == 12
    assert _leases(path) == 0
    assert GenerationCache(path).integrity_check() == "ok"


def _leases(path: Path) -> int:
    try:
        return table_rows(path, "leases")
    except sqlite3.OperationalError:  # the file is being created
        return -1


# -- in one process ---------------------------------------------------------------------------


def echo(messages, params):
    return "gen " + messages[-1]["content"]


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": str(i)}] for i in range(n)]


def keys_of(llm: CachedLLM, n: int) -> list[str]:
    return [llm.builder.key(p, SamplingParams()) for p in prompts(n)]


def test_claim_skips_rows_and_live_leases_and_takes_dead_ones(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    me, other = LeaseOwner.new(), LeaseOwner.new()
    assert cache.claim(["a", "b"], other).claimed == ["a", "b"]
    claim = cache.claim(["a", "b", "c"], me)
    assert claim.claimed == ["c"] and set(claim.held) == {"a", "b"} and claim.held["a"].token == other.token
    assert cache.claim(["a"], me, force=True).claimed == ["a"]

    # A pid that no longer runs, or that now names a process started at another time, is dead.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = LeaseOwner(other.host, gone.pid, "", "dead")
    reused = LeaseOwner(other.host, os.getpid(), "1", "reused")
    assert cache.claim(["d", "e"], dead).claimed == ["d", "e"]
    assert cache.claim(["f"], reused).claimed == ["f"]
    assert cache.claim(["d", "e", "f"], me).claimed == ["d", "e", "f"]

    # A killed process its parent has not reaped yet (a zombie) is dead too.
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cache.claim(["z"], LeaseOwner(other.host, zombie.pid, _pid_start(zombie.pid), "zombie"))
        assert set(cache.claim(["z"], me).held) == {"z"}  # alive: held
        zombie.send_signal(signal.SIGKILL)
        wait_for(lambda: _proc_stat(zombie.pid)[0] == "Z", "the zombie")
        assert cache.claim(["z"], me).claimed == ["z"]
    finally:
        zombie.kill()
        zombie.wait()

    # Another host's lease lives while its heartbeat is younger than the time to live.
    far = LeaseOwner("some-other-host", 1, "", "far")
    assert cache.claim(["g"], far).claimed == ["g"]
    assert set(cache.claim(["g"], me, ttl_s=60).held) == {"g"}
    with sqlite3.connect(cache.path) as raw:
        raw.execute("UPDATE leases SET heartbeat = heartbeat - 120 WHERE owner = 'far'")
    assert cache.claim(["g"], me, ttl_s=60).claimed == ["g"]


def test_leases_are_released_on_success_and_on_error(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    llm = CachedLLM(ScriptedLLM(echo, "fake-model"), "fake-model", "plain", cache, chunk_size=2)
    llm.generate(prompts(5), SamplingParams())
    assert table_rows(cache.path, "leases") == 0 and len(cache) == 5

    def boom(messages, params):
        if messages[-1]["content"] == "7":
            raise RuntimeError("backend died")
        return echo(messages, params)

    llm = CachedLLM(ScriptedLLM(boom, "fake-model"), "fake-model", "plain", cache, chunk_size=2)
    try:
        llm.generate(prompts(9), SamplingParams())
    except RuntimeError:
        pass
    else:
        raise AssertionError("the backend's error should propagate")
    assert table_rows(cache.path, "leases") == 0  # released: another run may generate them now
    assert len(cache) == 7  # 5 before, and the chunk (5, 6) committed before the failing one


def test_texts_leased_by_a_live_run_are_waited_for_not_generated(tmp_path, monkeypatch):
    """A lease held by a live owner (here this process under another token) is waited for; once
    it is released without a row (the owner gave up), this run generates the text itself."""
    cache = GenerationCache(tmp_path / "g.sqlite")
    backend = ScriptedLLM(echo, "fake-model")
    llm = CachedLLM(backend, "fake-model", "plain", cache, chunk_size=None)
    keys = keys_of(llm, 4)
    holder = LeaseOwner.new()
    cache.claim(keys[:2], holder)
    polls: list[float] = []

    def poll(seconds: float) -> None:  # while it waits, the holder writes one text, then gives up
        polls.append(seconds)
        if len(polls) == 1:
            req = llm.request(prompts(1)[0], SamplingParams())
            rec = CacheRecord.from_generation(keys[0], req, Generation(text="gen 0", final="gen 0"))
            cache.put_many([rec], release=holder)
        else:
            cache.release(holder)

    monkeypatch.setattr("r2med_agent.llm.cache.sharing.time.sleep", poll)
    out = llm.generate(prompts(4), SamplingParams())
    assert [g.text for g in out] == [f"gen {i}" for i in range(4)]
    assert [len(c) for c in backend.calls] == [2, 1]  # its own two, then the one given up
    assert llm.stats.generations == 3 and llm.stats.cache_hits == 1
    assert len(polls) == 2 and table_rows(cache.path, "leases") == 0


class Sampler(ScriptedLLM):
    """Draws ``n`` samples per prompt in one request (as vLLM's ``n``)."""

    def generate_samples(self, prompts, params, n, *, template_hash="", meta=None):
        self.calls.append([list(p) for p in prompts])
        return [[Generation(text=f"{echo(p, params)} #{s}") for s in range(n)] for p in prompts]


def test_samples_leased_by_another_run_are_waited_for(tmp_path, monkeypatch):
    cache = GenerationCache(tmp_path / "g.sqlite")
    backend = Sampler(echo, "fake-model")
    llm = CachedLLM(backend, "fake-model", "plain", cache)
    params = SamplingParams(seed=1)
    req = llm.request(prompts(2)[1], params, sample_index=1)
    holder = LeaseOwner.new()
    cache.claim([request_key(req)], holder)  # another run is drawing sample 1 of prompt "1"

    def poll(seconds: float) -> None:
        rec = CacheRecord.from_generation(request_key(req), req, Generation(text="theirs", final="theirs"))
        cache.put_many([rec], release=holder)

    monkeypatch.setattr("r2med_agent.llm.cache.sharing.time.sleep", poll)
    out = llm.generate_samples(prompts(2), params, 2)
    # Prompt "1" is still drawn (its sample 0 is missing) but the leased sample is not stored
    # over the other run's: it comes from that run.
    assert [[g.text for g in row] for row in out] == [["gen 0 #0", "gen 0 #1"], ["gen 1 #0", "theirs"]]
    assert len(backend.calls) == 1 and len(cache) == 4
    assert cache.get(request_key(req)).text == "theirs" and table_rows(cache.path, "leases") == 0
