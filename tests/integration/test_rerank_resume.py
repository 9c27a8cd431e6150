"""An LLM rerank killed mid-way resumes from the generation cache: the real local model reranks a
4-query task of one's own (listwise windows of 4 over the top 8: three window positions, one
engine call each for all queries), the run is SIGKILLed once the first window position's answers
are stored, and the next run makes only the rest, ending with the run an uninterrupted one writes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, cache: Path, env: dict[str, str], data: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "r2med_agent", "run", "--data-dir", str(data), "--reranker", "smollm2-listwise",
           "--rerank-k", "8", "-o", str(out), "--cache-path", str(cache), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _task(folder: Path) -> Path:
    """4 questions and 12 documents that all share words with them (BM25 ranks at least 8 each)."""
    folder.mkdir(parents=True)
    topics = ["fever", "anaemia", "asthma", "gout"]
    queries = {f"q{i}": f"What causes {t} in a patient with pain and fatigue?" for i, t in enumerate(topics)}
    docs = {f"d{j}": f"A patient with {topics[j % 4]} reports pain, fatigue and cause number {j}." for j in range(12)}
    (folder / "query.jsonl").write_text("".join(json.dumps({"id": q, "text": t}) + "\n" for q, t in queries.items()))
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"id": d, "text": t}) + "\n" for d, t in docs.items()))
    (folder / "qrels.jsonl").write_text("".join(
        json.dumps({"q_id": f"q{i}", "p_id": f"d{i}", "score": 1}) + "\n" for i in range(4)))
    return folder


def _rows(cache: Path) -> int:
    try:
        with sqlite3.connect(f"file:{cache}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT COUNT(*) FROM generations").fetchone()[0]
    except sqlite3.Error:
        return 0


def _stats(out: Path) -> dict:
    (rec,) = [json.loads(p.read_text()) for p in out.rglob("mine.json")]
    return rec["stats"]


def test_a_killed_llm_rerank_resumes_from_the_cache(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    data = _task(tmp_path / "mine")
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache-dir")}
    killed_out, cache = tmp_path / "killed", tmp_path / "gen.sqlite"
    proc = _run(killed_out, cache, env, data)
    deadline = time.monotonic() + 600
    try:
        while _rows(cache) < 4:  # the first window position: one answer per query
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the first window position never reached the cache"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    stored = _rows(cache)
    assert 4 <= stored < 12  # three window positions of 4 answers: killed before the end
    assert not list(killed_out.rglob("mine.json"))

    resumed = _run(killed_out, cache, env, data)
    assert resumed.wait(timeout=900) == 0, resumed.stderr.read().decode() if resumed.stderr else ""
    stats = _stats(killed_out)
    assert stats["rerank"]["cache_hits"] == stored and stats["rerank"]["generations"] == 12 - stored, stats

    fresh_out = tmp_path / "fresh"
    fresh = _run(fresh_out, tmp_path / "other.sqlite", env, data)
    assert fresh.wait(timeout=900) == 0
    runs = [next(o.rglob("mine.run")).read_text().split("\n") for o in (killed_out, fresh_out)]
    assert [line.split()[:4] for line in runs[0]] == [line.split()[:4] for line in runs[1]]
