"""The task cache under faults (issue 20 items 14, 15): a killed save's temporary is removed by the
next save; a full disk costs only the cache (a warning), never the run."""

from __future__ import annotations

import logging

from r2med_agent.data.snapshot import _TaskSnapshot
from r2med_agent.types import Query
from tests.integration.test_concurrency import HOST, _dead_pid, small_disk


def _save(snap: _TaskSnapshot, n: int = 1) -> None:
    snap.save([Query("q1", "text " * n)], ["d1"], {"q1": {"d1": 1}}, "fp", [])


def test_a_killed_saves_temporary_is_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    left = folder / f".abc.json.{HOST}~{_dead_pid()}.k1l2l3d4.tmp"
    left.write_text('{"format": 1, "queries"')
    snap = _TaskSnapshot(folder / "abc.json")
    _save(snap)
    assert sorted(p.name for p in folder.iterdir()) == ["abc.json"]
    assert snap.load() is not None


def test_a_full_disk_only_costs_the_task_cache(tmp_path, caplog):
    """(As before: atomic writes now raise DiskFullError on a full disk, which the task cache
    must still take as a warning.)"""
    with small_disk(tmp_path / "disk", "64k") as disk:
        snap = _TaskSnapshot(disk / "tasks" / "abc.json")
        with caplog.at_level(logging.WARNING):
            _save(snap, 100_000)
        assert "cannot write the task cache file" in caplog.text
        assert sorted(p.name for p in (disk / "tasks").iterdir()) == []
