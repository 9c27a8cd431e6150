"""A task's result files are one set (issue 20 item 16): a writer SIGKILLed at any point leaves
either the old set or the new one, and a reader never pairs one run's ``.json`` with another
run's ``.run``."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

from r2med_agent.analysis.results import load_results
from tests.integration.test_concurrency import finish, worker


def _consistent(root: Path) -> int | None:
    """The round of the task's set as a reader sees it (None: no result yet); fails on a mix."""
    rows = load_results([root])
    if not rows:
        return None
    (row,) = rows
    result = row.tasks["T"]
    n = int(result.scores["ndcg_cut_10"])
    assert json.loads(result.path.read_text())["round"] == n
    run_rounds = {line.split()[-1] for line in result.run_path.read_text().splitlines()}
    assert run_rounds == {f"round{n}"}, (n, run_rounds)
    if n % 2 == 0:
        gens = {json.loads(line)["round"] for line in result.generations_path.read_text().splitlines()}
        assert gens == {n}
    else:
        assert not result.generations_path.exists(), f"round {n} shows round {n - 1}'s generations"
    return n


def test_sigkill_anywhere_in_a_set_write_leaves_one_whole_set(tmp_path):
    folder = tmp_path / "none" / "none" / "bm25"
    rng = random.Random(20)
    seen = set()
    for _ in range(25):
        p = worker("results", folder, 10_000)
        assert p.stdout is not None
        p.stdout.readline()  # one set written: the next ones are being written now
        time.sleep(rng.uniform(0, 0.05))
        p.send_signal(signal.SIGKILL)
        p.wait()
        seen.add(_consistent(tmp_path))
    assert len(seen) > 1  # the kills fell on different rounds
    # the next write finishes what a kill left and removes its staging folders
    rc, _, err = finish(worker("results", folder, 1))
    assert rc == 0, err
    assert _consistent(tmp_path) == 0
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "T.generations.jsonl", "T.json", "T.run"]


def test_a_committed_set_is_read_through_before_it_is_moved_into_place(tmp_path):
    """The state a kill right after the commit leaves: the new set in ``.T.set/``, the old one
    in the folder. Readers see the new one only; the next write of the folder finishes it."""
    from r2med_agent.experiment.store import finish_pending_sets, task_set_files

    folder = tmp_path / "none" / "none" / "bm25"
    folder.mkdir(parents=True)
    (folder / "T.json").write_text('{"dataset_name": "T", "round": 1, "test": {"ndcg_cut_10": 1}}')
    (folder / "T.run").write_text("q Q0 d1 1 1.0 round1\n")
    (folder / "T.generations.jsonl").write_text('{"round": 1}\n')
    pending = folder / ".T.set"
    pending.mkdir()
    (pending / "T.json").write_text('{"dataset_name": "T", "round": 3, "test": {"ndcg_cut_10": 3}}')
    (pending / "set.json").write_text('{"task": "T", "files": ["T.run", "T.json"]}')
    (folder / "T.run").write_text("q Q0 d3 1 1.0 round3\n")  # moved already

    assert _consistent(tmp_path) == 3
    assert task_set_files(folder, "T")[".json"] == pending / "T.json"
    finish_pending_sets(folder)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "T.json", "T.run"]
    assert _consistent(tmp_path) == 3
