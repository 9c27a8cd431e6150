"""Shared caches under real concurrency and real faults: several processes building the same
embeddings, a SIGKILL in the middle of a save, a full disk (a small tmpfs mounted for the test).

The processes are ``python -m tests.concurrency_worker`` (a deterministic hash encoder: they race
on the cache, not on a model).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname())
"""This host as temporaries name their writer (``.<target>.<host>~<pid>.<random>.tmp``)."""


def worker(*args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.concurrency_worker", *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp")]


# ---------------------------------------------------------------------------- concurrent builds


def test_concurrent_dense_builds_all_succeed_and_agree(tmp_path):
    """Issue 20 items 2 and 12: eight processes encode the same corpus at once. Before the build
    lock, the first to finish removed the shard folder the others were writing into (their
    ``_atomic_save_npy`` died with FileNotFoundError). Now one encodes, the others wait for it and
    load its matrix: every process exits 0 with the same embeddings and nothing is left over."""
    procs = [worker("dense", tmp_path, 400, 10, 0.05) for _ in range(8)]
    results = [finish(p) for p in procs]
    failed = [(rc, err[-600:]) for rc, _, err in results if rc != 0]
    assert not failed, failed
    assert len({out.strip() for _, out, _ in results}) == 1
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "embeddings.npy", "meta.json"]
    assert np.load(folder / "embeddings.npy").shape == (400, 16)


# ---------------------------------------------------------------------------- kills and orphans


def _kill_when(p: subprocess.Popen[str], ready: callable, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if p.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"worker ended before the kill point: {p.communicate()}")
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_killed_dense_build_leaves_temporaries_the_next_run_removes(tmp_path):
    """Issue 20 item 15: a SIGKILLed encoder leaves its shard temporaries; the next build of the
    same embeddings (its writer is dead) removes them, resumes and finishes clean."""
    p = worker("dense", tmp_path, 400, 2, 0.05)
    _kill_when(p, lambda: len(list(tmp_path.rglob("0000[3-9].npy"))) > 0)
    # a leftover of a dead writer, as a kill inside the save leaves (the kill point is random)
    # what a merge killed in the middle leaves (the kill point above is random)
    folder = next(tmp_path.rglob("shards")).parent
    (folder / f".embeddings.npy.{HOST}~{_dead_pid()}.abcd1234.tmp").write_bytes(b"x" * 4096)
    rc, _, err = finish(worker("dense", tmp_path, 400, 2, 0.0))
    assert rc == 0, err
    assert temporaries(tmp_path) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_killed_bm25_save_folder_is_removed_by_the_next_save(tmp_path):
    """Issue 20 item 15: a BM25 save killed while writing leaves its temporary folder; the next
    save next to it removes it (its writer is dead), and a live writer's folder is kept."""
    p = worker("bm25", tmp_path, 60000)
    _kill_when(p, lambda: any(tmp_path.glob(".conc-*.tmp")))
    assert any(tmp_path.glob(".conc-*.tmp"))
    live = tmp_path / f".other-index.{HOST}~{os.getpid()}.live0000.tmp"
    live.mkdir()  # this (live) process's own temporary: never removed
    rc, _, err = finish(worker("bm25", tmp_path, 60000))
    assert rc == 0, err
    assert [t.name for t in temporaries(tmp_path)] == [live.name]


# ---------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (root only; the test is skipped otherwise)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the full-disk test needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_in_the_embedding_merge_is_one_message(tmp_path):
    """Issue 20 item 14: the shards fit, their merge does not. Before, the memory-mapped merge
    died of SIGBUS (exit -7, no message) and left its temporary filling the disk. Now: exit 6,
    one line naming embeddings.npy and the space needed, no temporary, the shards intact (a run
    with more space resumes from them)."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        # 12000 x 16 float32: 768 kB of shards fit on the 1 MB disk, the 768 kB merge does not
        rc, _, err = finish(worker("dense", disk, 12000, 4000, 0.0))
        assert rc == 6, (rc, err[-800:])
        assert "Traceback" not in err
        assert "embeddings.npy: no space left on the device" in err and re.search(r"about [0-9.]+ [kM]B more needed", err)
        assert temporaries(disk) == []
        shards = sorted(p.name for p in disk.rglob("shards/*.npy"))
        assert shards == ["00000.npy", "00001.npy", "00002.npy"]


def test_full_disk_in_the_bm25_save_is_one_message(tmp_path):
    """Issue 20 item 14: a BM25 index larger than the disk. Before, a raw OSError traceback;
    now exit 6 and one line naming the index folder, no temporary folder left."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        rc, _, err = finish(worker("bm25", disk, 60000))
        assert rc == 6, (rc, err[-800:])
        assert "Traceback" not in err
        assert f"{disk}/conc-lucene-" in err and "no space left on the device" in err
        assert list(disk.iterdir()) == []


def test_full_disk_in_a_result_set_keeps_the_old_set(tmp_path):
    """Issue 20 item 14 (result writes): a task's new result set does not fit. DiskFullError
    names the result file, the old set is whole and no temporary is left."""
    from r2med_agent.errors import DiskFullError
    from r2med_agent.experiment.store import write_task_set

    with small_disk(tmp_path / "disk", "1m") as disk:
        folder = disk / "none" / "none" / "bm25"
        write_task_set(folder, "T", {".run": "q Q0 d1 1 1.0 old\n", ".json": '{"round": 0}\n'})
        with pytest.raises(DiskFullError, match=r"bm25/T.json: no space left on the device \(about"):
            write_task_set(folder, "T", {".run": "q Q0 d2 1 1.0 new\n" * 100_000, ".json": "{}\n"})
        assert (folder / "T.json").read_text() == '{"round": 0}\n'
        assert (folder / "T.run").read_text() == "q Q0 d1 1 1.0 old\n"
        assert sorted(p.name for p in folder.iterdir()) == [".lock", "T.json", "T.run"]


def test_preallocate_on_a_full_disk_is_disk_full_not_sigbus(tmp_path):
    """The guard under the memory-mapped merge: reserving more than the disk holds fails at once
    with DiskFullError (a free-space check can be raced by another writer; this cannot)."""
    from r2med_agent.errors import DiskFullError
    from r2med_agent.io import preallocate

    with small_disk(tmp_path / "disk", "1m") as disk:
        path = disk / "big.npy"
        with open(path, "wb") as f, pytest.raises(DiskFullError, match=r"big.npy: no space left"):
            preallocate(f.fileno(), 4 << 20, path)


def test_full_disk_in_a_run_is_one_message_from_the_cli(tmp_path, capsys):
    """Issue 20 item 14 (result writes), through ``r2med-agent run``: the results folder fits
    spec.json but not the task's files. Before, an OSError traceback; now exit 6, one line naming
    the result file, spec.json intact and no temporary left."""
    from r2med_agent.cli.app import main

    with small_disk(tmp_path / "disk", "32k") as disk:
        code = main(["run", "--task", "sample", "--retriever", "bm25", "-o", str(disk), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 6, err
        folder = disk / "none" / "none" / "bm25"
        assert f"error: {folder}/sample.json: no space left on the device (about" in err
        assert sorted(p.name for p in folder.iterdir()) == [".lock", "spec.json"]
        assert (folder / "spec.json").read_text().startswith("{")


def test_full_disk_while_saving_shards_is_one_message(tmp_path):
    """Issue 20 item 14: the shards themselves do not fit. Exit 6 naming the shard, the shards
    saved before it intact, no temporary left."""
    with small_disk(tmp_path / "disk", "256k") as disk:
        # shards of 1000 x 16 float32 (64 kB each): three fit, the fourth does not
        rc, _, err = finish(worker("dense", disk, 12000, 1000, 0.0))
        assert rc == 6, (rc, err[-800:])
        assert "Traceback" not in err and "no space left on the device" in err
        assert "/shards/000" in err
        assert temporaries(disk) == []
        saved = sorted(disk.rglob("shards/*.npy"))
        assert saved and all(np.load(p).shape == (1000, 16) for p in saved)
