"""A damaged generation cache (issue 39 item 10): bytes overwritten past the header give one line
naming the file and ``cache repair`` (exit 2), in ``run`` and ``cache stats``, never SQLite's
traceback; ``cache repair`` keeps every generation it can still read in a new file and moves the
damaged one aside; a cache file cut to 0 bytes is named in a warning, not taken as new in silence."""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.registry import get_llm_spec
from r2med_agent.llm.cache.records import Use
from tests.fakes import ScriptedLLM
from tests.unit.llm.cache.test_cache import record

ROWS = 2000


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> Path:
    """A cache of ROWS generations (300 characters each), each with a use."""
    path = tmp_path_factory.mktemp("sound") / "gen.sqlite"
    cache = GenerationCache(path)
    cache.put_many([record(f"k{i}", "x" * 300 + str(i)) for i in range(ROWS)],
                   uses=[Use(f"k{i}", "sample", str(i), "hyde", {}) for i in range(ROWS)])
    cache.close()
    assert not Path(f"{path}-wal").exists()  # checkpointed: every row is in the file
    return path


def damaged(sound: Path, folder: Path, how: str) -> Path:
    """A copy of ``sound`` with 4 kB of random bytes a third in, or zeros at 4-12 kB."""
    path = folder / "gen.sqlite"
    shutil.copyfile(sound, path)
    data = bytearray(path.read_bytes())
    if how == "random":
        at = len(data) // 3
        data[at:at + 4096] = random.Random(39).randbytes(4096)
    else:
        data[4096:12288] = bytes(8192)
    path.write_bytes(bytes(data))
    return path


def _one_line(err: str, path: Path) -> None:
    assert "Traceback" not in err and "sqlite3" not in err, err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert str(path) in line and "the generation cache file is damaged (database disk image is malformed)" in line
    assert f"r2med-agent cache repair --cache-path {path}" in line


@pytest.mark.parametrize("how", ["random", "zeros"])
def test_cache_stats_on_a_damaged_cache_is_one_line(sound, tmp_path, capsys, how):
    path = damaged(sound, tmp_path, how)
    assert main(["cache", "stats", "--cache-path", str(path)]) == 2
    _one_line(capsys.readouterr().err, path)


@pytest.mark.parametrize("how", ["random", "zeros"])
def test_a_run_on_a_damaged_cache_is_one_line(sound, tmp_path, capsys, monkeypatch, how):
    from r2med_agent.llm.cache.wrapper import CachedLLM

    path = damaged(sound, tmp_path, how)

    def make_llm(name, **_):
        model = get_llm_spec(name).model
        return CachedLLM(ScriptedLLM(lambda m, p: "a passage", model_id=model), model, "plain", GenerationCache(path))

    monkeypatch.setattr("r2med_agent.llm.make_llm", make_llm)
    code = main(["run", "--task", "sample", "--method", "hyde", "--llm", "qwen-7b", "--prompts", "own",
                 "-o", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    _one_line(capsys.readouterr().err, path)


@pytest.mark.parametrize("how", ["random", "zeros"])
def test_cache_repair_keeps_what_can_be_read_and_moves_the_damaged_file_aside(sound, tmp_path, capsys, how):
    path = damaged(sound, tmp_path, how)
    original = path.read_bytes()
    assert main(["cache", "repair", "--cache-path", str(path)]) == 0
    out = capsys.readouterr().out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("gen.sqlite.damaged-") and p.suffix != ""
                and not p.name.endswith(("-wal", "-shm"))]
    assert aside.read_bytes() == original  # moved, not changed: nothing was deleted
    cache = GenerationCache(path)
    assert cache.integrity_check() == "ok"
    kept = {r.key: r.text for r in cache.iter_records()}
    uses = cache.uses()
    # every generation kept is the one stored, whole; a use is kept only with its generation
    assert all(kept[k] == "x" * 300 + k[1:] for k in kept)
    assert {u.key for u, _ in uses} <= set(kept)
    if how == "random":  # 4 kB of a 2.3 MB file: all but a few rows are readable
        assert ROWS - 20 < len(kept) < ROWS
    assert f"kept {len(kept)} generations" in out and str(aside) in out
    # the repaired cache serves and takes generations again
    cache.put_many([record("new")])
    assert len(cache) == len(kept) + 1
    cache.close()
    assert main(["cache", "stats", "--cache-path", str(path), "--json"]) == 0


def test_cache_repair_refuses_a_sound_cache(sound, tmp_path, capsys):
    path = tmp_path / "gen.sqlite"
    shutil.copyfile(sound, path)
    assert main(["cache", "repair", "--cache-path", str(path)]) == 2
    assert "sound (SQLite's integrity check: ok); nothing to repair" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.sqlite"]


def test_a_cache_cut_to_nothing_is_named_in_a_warning(tmp_path, caplog, capsys):
    path = tmp_path / "gen.sqlite"
    path.write_bytes(b"")
    old = time.time() - 3600
    os.utime(path, (old, old))
    with caplog.at_level(logging.WARNING):
        assert main(["cache", "stats", "--cache-path", str(path), "--json"]) == 0
    assert f"generation cache {path} is an empty file (0 bytes)" in caplog.text
    assert "restore it from a backup" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # written now: a cache like any other
        assert main(["cache", "stats", "--cache-path", str(path), "--json"]) == 0
    assert "empty file" not in caplog.text


def test_generations_a_damaged_cache_refuses_are_kept_beside_it_and_repaired_in(sound, tmp_path, capsys):
    from r2med_agent.llm.cache.store import CacheDamagedError

    path = damaged(sound, tmp_path, "zeros")
    with pytest.raises(CacheDamagedError) as err:
        GenerationCache(path).put_many([record("paid1", "first answer"), record("paid2", "second answer")],
                                       uses=[Use("paid1", "sample", "q1", "hyde", {})])
    (unsaved,) = tmp_path.glob("gen.sqlite.unsaved-*.jsonl")
    assert f"the 2 generations just made could not go into it and are kept in {unsaved}" in str(err.value)
    assert main(["cache", "repair", "--cache-path", str(path)]) == 0
    assert "(with the 2 a run could not write into it)" in capsys.readouterr().out
    cache = GenerationCache(path)
    got = cache.get_many(["paid1", "paid2", "k7"])
    assert {k: r.text for k, r in got.items()} == {"paid1": "first answer", "paid2": "second answer",
                                                   "k7": "x" * 300 + "7"}
    assert [(u.key, u.query_id) for u, _ in cache.uses(task="sample") if u.key.startswith("paid")] == [("paid1", "q1")]
    assert not unsaved.exists() and Path(f"{unsaved}.added").exists()  # added once, kept, not read again
