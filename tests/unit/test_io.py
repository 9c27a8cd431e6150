"""Output safety: atomic replacement is for regular files only; symlinks are written through,
FIFOs and devices in place, ``-`` is standard output, and bad output paths are one message."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.io import atomic_write_text, write_output
from tests.result_trees import MIXED, write_result


def test_regular_file_is_replaced_atomically(tmp_path):
    path = tmp_path / "a" / "out.txt"
    atomic_write_text(path, "one\n")
    atomic_write_text(path, "two\n")
    assert path.read_text() == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]  # no temp file left


def test_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real" / "table.md"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    atomic_write_text(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.md", "real"]


def test_dangling_symlink_creates_its_target(tmp_path):
    target = tmp_path / "made.txt"
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    atomic_write_text(link, "x\n")
    assert link.is_symlink() and target.read_text() == "x\n"


def test_fifo_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    atomic_write_text(fifo, "through the pipe\n")
    reader.join(timeout=10)
    assert got == ["through the pipe\n"]
    assert fifo.is_fifo()  # still a FIFO, not a regular file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_dash_is_standard_output(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_output("-", "to stdout\n")
    assert capsys.readouterr().out == "to stdout\n"
    assert not (tmp_path / "-").exists()


def test_parent_that_is_a_file_is_one_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*file/table.md: cannot write there"):
        write_output(blocker / "table.md", "x")


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    write_result(root, "none", "none", "bm25", "sample", MIXED)
    return root


def test_cli_compare_out_dash_symlink_and_bad_parent(tmp_path, capsys):
    from r2med_agent.cli import main

    root = _tree(tmp_path)
    assert main(["compare", str(root), "--out", "-", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("index,method,") and "bm25" in out
    assert not Path("-").exists()

    target = tmp_path / "kept" / "table.md"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "table.md"
    link.symlink_to(target)
    assert main(["compare", str(root), "--out", str(link)]) == 0
    assert link.is_symlink() and "bm25" in target.read_text()

    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    assert main(["compare", str(root), "--out", str(blocker / "t.md")]) == 2
    err = capsys.readouterr().err
    assert "cannot write there" in err and "Traceback" not in err
    assert blocker.read_text() == "x"


def test_cli_report_out_existing_file_is_one_message(tmp_path, capsys):
    from r2med_agent.cli import main

    root = _tree(tmp_path)
    existing = tmp_path / "report.txt"
    existing.write_text("mine")
    assert main(["report", str(root), "--out", str(existing), "--no-texts"]) == 2
    err = capsys.readouterr().err
    assert "is a file; the report needs a folder" in err and "Traceback" not in err
    assert existing.read_text() == "mine"


def test_a_control_character_in_json_is_named_once(tmp_path):
    """json's message for a raw control character ends in "at"; the file:line error says it once."""
    from r2med_agent.errors import DataError
    from r2med_agent.io import read_json

    bad = tmp_path / "r.json"
    bad.write_text('{"text": "a\tb"}')
    with pytest.raises(DataError) as info:
        read_json(bad, "result file")
    assert "Invalid control character at column 12" in str(info.value)
    assert "at at" not in str(info.value) and "r.json:1" in str(info.value)


# -- temporaries of dead writers (issue 20 item 15) --------------------------------------------


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_of_dead_writers_are_removed_never_a_live_ones(tmp_path):
    from r2med_agent.io import STALE_AFTER_S, remove_stale_temps, temp_prefix

    mine = temp_prefix(tmp_path / "a.json")
    assert mine.startswith(".a.json.") and mine.endswith(f"~{os.getpid()}.")  # .<name>.<host>~<pid>.
    host = mine[len(".a.json."):].split("~")[0]
    live = tmp_path / f"{mine}live0001.tmp"
    dead = tmp_path / f".a.json.{host}~{_dead_pid()}.dead0001.tmp"
    dead_dir = tmp_path / f".idx.{host}~{_dead_pid()}.dead0002.tmp"
    other_host_new = tmp_path / ".a.json.elsewhere~1.new00001.tmp"
    other_host_old = tmp_path / ".a.json.elsewhere~1.old00001.tmp"
    legacy_old = tmp_path / ".a.json.k2j3h4g5.tmp"  # an older version's name: no writer in it
    legacy_new = tmp_path / ".b.json.k2j3h4g6.tmp"
    for p in (live, dead, other_host_new, other_host_old, legacy_old, legacy_new):
        p.write_text("x")
    dead_dir.mkdir()
    (dead_dir / "terms.txt").write_text("x")
    old = time.time() - STALE_AFTER_S - 60
    for p in (other_host_old, legacy_old):
        os.utime(p, (old, old))
    removed = remove_stale_temps(tmp_path)
    assert sorted(p.name for p in removed) == sorted(p.name for p in (dead, dead_dir, other_host_old, legacy_old))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, other_host_new, legacy_new))


def test_atomic_write_names_its_temporary_by_its_writer(tmp_path, monkeypatch):
    from r2med_agent import io

    seen: list[str] = []
    real = os.replace
    monkeypatch.setattr(io.os, "replace", lambda a, b: (seen.append(os.path.basename(a)), real(a, b)))
    atomic_write_text(tmp_path / "out.json", "{}\n")
    (name,) = seen
    assert name.startswith(io.temp_prefix(tmp_path / "out.json")) and name.endswith(".tmp")


def test_a_short_numpy_write_counts_as_a_full_disk(tmp_path):
    from r2med_agent.errors import DiskFullError
    from r2med_agent.io import raise_if_disk_full

    with pytest.raises(DiskFullError, match=r"x.npy: no space left on the device \(about"):
        raise_if_disk_full(OSError("359993 requested and 141280 written"), tmp_path / "x.npy", 1 << 60)
    raise_if_disk_full(OSError("something else"), tmp_path / "x.npy", 10)  # not a full disk: returns


def test_cli_report_on_a_full_disk_is_one_message_and_keeps_the_old_plots(tmp_path, capsys):
    """Issue 29 item 6: the plots were written in place, so a full disk printed PIL's traceback,
    exited 1 and left a truncated PNG."""
    import os

    from r2med_agent.cli import main
    from tests.integration.test_concurrency import small_disk

    root = _tree(tmp_path)
    with small_disk(tmp_path / "disk", "1m") as disk:
        out = disk / "report"
        assert main(["report", str(root), "--out", str(out), "--no-texts"]) == 0
        old = {p.name: p.read_bytes() for p in out.iterdir()}
        assert sorted(old) == ["per_task.png", "quality_vs_cost.png", "report.html"]
        st = os.statvfs(disk)
        (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 4096))
        for folder in (disk / "new", out):  # a new report, then the old one rewritten
            code = main(["report", str(root), "--out", str(folder), "--no-texts", "--title", "again"])
            err = capsys.readouterr().err
            assert code == 6, err
            assert f"{folder / 'per_task.png'}: no space left on the device" in err and "Traceback" not in err
        assert list((disk / "new").iterdir()) == []  # no temporary, no PNG cut short
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old
