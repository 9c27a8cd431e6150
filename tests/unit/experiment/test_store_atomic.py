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


# -- summary.json in the set (issue 29 item 7) ---------------------------------------------------

_KILLED_RUN = """
import os, signal, sys
from r2med_agent.experiment import store
real, calls = store._finish_set, []
def finish(folder, task):  # the second call moves the committed set into place
    calls.append(task)
    if sys.argv[1] == "committed" and len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(folder, task)
    if sys.argv[1] == "moved" and len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
store._finish_set = finish
from r2med_agent.cli.app import main
sys.exit(main(sys.argv[2:]))
"""


def _summary_and_task(folder: Path, task: str) -> tuple[dict, dict]:
    """The scores the folder's summary.json gives the task, and those of its <Task>.json, as a
    reader of the files sees them."""
    summary = json.loads((folder / "summary.json").read_text())
    return summary["per_task"][task], json.loads((folder / f"{task}.json").read_text())["test"]


def test_a_run_killed_after_its_task_files_leaves_a_summary_of_the_same_scores(tmp_path):
    """Before, summary.json was written after every task's set: a kill in between left the
    previous run's scores in it beside the new <Task>.json (5 of 30 kill trials)."""
    import os
    import shutil
    import subprocess
    import sys

    from r2med_agent.cli import main
    from r2med_agent.paths import resources_dir

    data = tmp_path / "mine"
    shutil.copytree(resources_dir() / "sample", data)
    out = tmp_path / "results"
    args = ["run", "--data-dir", str(data), "-o", str(out), "--no-progress"]
    assert main(args) == 0
    folder = out / "none" / "none" / "bm25"
    first = _summary_and_task(folder, "mine")
    assert first[0] == first[1]
    # other judgments: the same spec scores differently. Other data is filed beside a result
    # (mine@data-...), so the first result loses its fingerprints, as versions before them wrote
    # it: a result of unknown data is replaced, and the set below replaces it.
    record = json.loads((folder / "mine.json").read_text())
    del record["data_fingerprint"], record["corpus_fingerprint"]
    (folder / "mine.json").write_text(json.dumps(record))
    qrels = data / "qrels.jsonl"
    rows = qrels.read_text(encoding="utf-8").splitlines()
    qrels.write_text("\n".join(rows[: len(rows) // 2]) + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    for point in ("committed", "moved"):
        killed = subprocess.run([sys.executable, "-c", _KILLED_RUN, point, *args], env=env,
                                capture_output=True, text=True, timeout=300)
        assert killed.returncode == -9, killed.stderr[-2000:]
        summary, task = _summary_and_task(folder, "mine")
        assert summary == task, point  # the old scores in both, or the new ones in both
        assert (summary == first[0]) == (point == "committed")
        if point == "committed":  # the next write finishes the set: the new scores in both
            from r2med_agent.experiment.store import finish_pending_sets

            finish_pending_sets(folder)
            summary, task = _summary_and_task(folder, "mine")
            assert summary == task != first[0]
    assert main(args) == 0
    assert not list(folder.glob(".*.set")) and not list(folder.glob(".*.tmp"))
    summary, task = _summary_and_task(folder, "mine")
    assert summary == task != first[0]
