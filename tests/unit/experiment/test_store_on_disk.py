"""A task's files agree on disk, not only through the library's readers (issue 39 item 12): a
writer SIGKILLed while it moves a committed set into place left the new ``T.run`` beside the old
``T.json``. ``T.json`` now marks a whole set on disk: the old one goes before any file moves and
the new one comes last, so wherever a kill falls, a ``T.json`` in the folder sits beside its own
``T.run`` (and the readers read the pending set meanwhile)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.experiment.test_store_atomic import _consistent
from tests.integration.test_concurrency import finish, worker

ROOT = Path(__file__).resolve().parents[3]

_KILL_WHILE_MOVING = """
import os, signal, sys
from pathlib import Path
from tests.concurrency_worker import _results
from r2med_agent.experiment import store
folder, kill_at = Path(sys.argv[1]), int(sys.argv[2])
_results(folder, 1)  # round 0, whole
real, moved = os.replace, [0]
def replace(src, dst, *args, **kwargs):
    if Path(src).parent.name == ".T.set":  # a file of the committed set moving into place
        moved[0] += 1
        if moved[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *args, **kwargs)
os.replace = replace
store.write_task_set(folder, "T", {".run": "q Q0 d1 1 1.0 round1\\n", ".json": '{"dataset_name": "T", "round": 1, "test": {"ndcg_cut_10": 1}}\\n'})
"""


def on_disk(folder: Path) -> int | None:
    """The round of the folder's own ``T.json`` (None: none), its ``T.run`` and generations
    checked to be of the same round, reading the files as any tool would."""
    path = folder / "T.json"
    if not path.exists():
        return None
    n = json.loads(path.read_text())["round"]
    rounds = {line.split()[-1] for line in (folder / "T.run").read_text().splitlines()}
    assert rounds == {f"round{n}"}, f"T.json of round {n} beside a T.run of {rounds}"
    gens = folder / "T.generations.jsonl"
    if n % 2 == 0:
        assert {json.loads(x)["round"] for x in gens.read_text().splitlines()} == {n}
    else:
        assert not gens.exists(), f"T.json of round {n} beside round {n - 1}'s generations"
    return n


@pytest.mark.parametrize("kill_at", [1, 2])
def test_a_kill_between_the_moves_leaves_no_mixed_pair_on_disk(tmp_path, kill_at):
    folder = tmp_path / "none" / "none" / "bm25"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _KILL_WHILE_MOVING, str(folder), str(kill_at)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert on_disk(folder) is None  # round 0's T.json went before round 1's files came
    assert _consistent(tmp_path) == 1  # the library reads the committed set
    rc, _, err = finish(worker("results", folder, 1))  # the next write finishes it
    assert rc == 0, err
    assert on_disk(folder) == 0


def test_sigkill_at_varied_delays_never_leaves_a_mixed_pair_on_disk(tmp_path):
    folder = tmp_path / "none" / "none" / "bm25"
    rng = random.Random(39)
    for _ in range(25):
        p = worker("results", folder, 10_000)
        assert p.stdout is not None
        p.stdout.readline()
        time.sleep(rng.uniform(0, 0.05))
        p.send_signal(signal.SIGKILL)
        p.wait()
        on_disk(folder)
        _consistent(tmp_path)
