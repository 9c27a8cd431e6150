"""What the generation cache stores when things go wrong: empty replies (``content: null``) are
never cached as successes, and a full disk (a real small tmpfs) stops with one clear error that
keeps every row written before it."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import pytest

from r2med_agent.errors import DiskFullError
from r2med_agent.llm.cache.store import CacheRecord, GenerationCache
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.types import Generation, SamplingParams
from tests.fakes import ScriptedLLM


def prompts(*qs: str) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in qs]


class NullContent(ScriptedLLM):
    """Answers "b" with no text at all, as an OpenAI-compatible server's ``content: null`` (None)
    or ``""`` comes through the HTTP client, with a normal ``stop``."""

    def __init__(self, empty: str | None) -> None:
        super().__init__(lambda m, p: "text of " + m[-1]["content"], "fake-model")
        self.empty = empty

    def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
        out = super().generate(prompts, params)
        return [
            Generation(text=self.empty, finish_reason="stop", completion_tokens=0)  # type: ignore[arg-type]
            if p[-1]["content"] == "b" else g
            for p, g in zip(prompts, out)
        ]


@pytest.mark.parametrize("empty", [None, "", " \n"])
def test_an_empty_reply_is_counted_warned_and_not_cached(tmp_path, caplog, empty):
    backend = NullContent(empty)
    llm = CachedLLM(backend, "fake-model", "plain", GenerationCache(tmp_path / "g.sqlite"))
    with caplog.at_level(logging.WARNING, logger="r2med_agent.llm.cache.wrapper"):
        out = llm.generate(prompts("a", "b", "c"), SamplingParams())
    assert [g.text for g in out] == ["text of a", empty or "", "text of c"]
    assert [g.finish_reason for g in out] == ["stop", "error", "stop"]
    assert llm.stats.empty == 1
    assert "1 of 3 replies came back without any text" in caplog.text
    assert len(llm.cache) == 2  # a and c only

    # The next run asks for it again instead of reusing an empty text.
    again = llm.generate(prompts("a", "b", "c"), SamplingParams())
    assert backend.calls[-1] == prompts("b")
    assert [g.cached for g in again] == [True, False, True] and llm.stats.empty == 2


def test_a_reply_cut_at_the_token_limit_is_cached_even_if_empty(tmp_path):
    class Cut(ScriptedLLM):
        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            return [Generation(text="", finish_reason="length", completion_tokens=8) for _ in prompts]

    llm = CachedLLM(Cut(lambda m, p: "", "fake-model"), "fake-model", "plain", GenerationCache(tmp_path / "g.sqlite"))
    llm.generate(prompts("a"), SamplingParams(max_tokens=8))
    assert llm.stats.empty == 0 and len(llm.cache) == 1


# -- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path / "disk"`` (skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def big_record(i: int) -> CacheRecord:
    req = {"model_id": "m", "messages": [{"role": "user", "content": str(i)}], "sample_index": 0}
    text = f"{i} " + "x" * 100_000
    return CacheRecord.from_generation(f"k{i:03d}", req, Generation(text=text, final=text), created=time.time())


def test_a_full_disk_raises_one_clear_error_and_keeps_earlier_rows(small_disk):
    path = small_disk / "g.sqlite"
    cache = GenerationCache(path)
    stored = 0
    with pytest.raises(DiskFullError) as err:
        for start in range(0, 100, 2):  # 200 kB per transaction into 1 MiB: it fills up
            cache.put_many([big_record(i) for i in range(start, start + 2)])
            stored += 2
    assert 0 < stored < 100
    assert err.value.path == path and err.value.exit_code == 6
    assert err.value.needed_bytes and err.value.needed_bytes >= 200_000
    assert str(path) in str(err.value) and "no space left" in str(err.value)
    assert len(cache) == stored and cache.integrity_check() == "ok"
    assert sorted(cache.get_many([f"k{i:03d}" for i in range(stored)])) == [f"k{i:03d}" for i in range(stored)]
    cache.close()
    # Only the database and its WAL/shared-memory companions: no temporary file left behind.
    assert {p.name for p in small_disk.iterdir()} <= {"g.sqlite", "g.sqlite-wal", "g.sqlite-shm"}
    reopened = GenerationCache(path)
    assert len(reopened) == stored and reopened.integrity_check() == "ok"


def test_cli_import_on_a_full_disk_exits_6_with_one_message(small_disk, tmp_path, capsys):
    from r2med_agent.cli.app import main
    from tests.unit.llm.cache.test_cache import R2MED_ROWS, write_task_dir

    data = write_task_dir(tmp_path / "data")
    rows = [{**r, "hy_doc": r["hy_doc"] + " y" * 400_000} for r in R2MED_ROWS]  # ~0.8 MB each
    hyde_file = tmp_path / "query_with_hydoc.jsonl"
    hyde_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    db = small_disk / "g.sqlite"
    code = main(["cache", "import", str(hyde_file), "--task", "Biology", "--method", "hyde", "--llm", "qwen-7b",
                 "--prompts", "own", "--data-dir", str(data), "--allow-count-mismatch", "--cache-path", str(db)])
    err = capsys.readouterr().err
    assert code == 6, err
    assert f"{db}: no space left on the device (about" in err and "Traceback" not in err
    assert len(GenerationCache(db)) == 0 and GenerationCache(db).integrity_check() == "ok"
    assert {p.name for p in Path(small_disk).iterdir()} <= {"g.sqlite", "g.sqlite-wal", "g.sqlite-shm"}


# -- a nearly full disk (issue 29 item 6) ------------------------------------------------------


def leave_free(disk: Path, kilobytes: int) -> None:
    """Fill ``disk`` (a tmpfs) so that about ``kilobytes`` kB stay free."""
    import os

    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * max(st.f_bavail * st.f_frsize - kilobytes * 1024, 0))


@pytest.mark.parametrize("free_kb", [8, 16, 32])
def test_opening_a_cache_with_a_few_kilobytes_free_is_disk_full(small_disk, free_kb, capsys):
    """SQLite reports the 32 kB shared-memory file that does not fit as "disk I/O error": it was a
    DataError (exit 2) when the cache was made or `cache stats` opened it."""
    from r2med_agent.cli.app import main

    existing = small_disk / "old.sqlite"
    with GenerationCache(existing) as made:
        made.put_many([big_record(1)])
    for companion in small_disk.glob("old.sqlite-*"):
        companion.unlink()
    leave_free(small_disk, free_kb)
    with pytest.raises(DiskFullError) as err:
        len(GenerationCache(small_disk / "new.sqlite"))
    assert err.value.exit_code == 6 and "disk I/O error" not in str(err.value)
    code = main(["cache", "stats", "--cache-path", str(existing)])
    out = capsys.readouterr()
    if code != 0:  # with 32 kB free the shared-memory file fits and stats are read
        assert code == 6, out.err
        assert f"{existing}: no space left on the device" in out.err and "I/O" not in out.err
    else:
        assert free_kb == 32


def test_a_full_cache_says_so_once_without_a_lease_warning(small_disk, caplog):
    """The disk fills up while the model works (another process writes): storing the answers
    fails, and so does dropping the leases. Before, a lease-release warning came first, and the
    error said "about 0.0 MB more needed"."""
    import os

    def answer(messages, params):
        filler = small_disk / "filler"
        if not filler.exists():
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
        return "answer " * 50

    llm = CachedLLM(ScriptedLLM(answer, "fake-model"), "fake-model", "plain",
                    GenerationCache(small_disk / "g.sqlite"), chunk_size=2)
    with caplog.at_level(logging.WARNING, logger="r2med_agent"), pytest.raises(DiskFullError) as err:
        llm.generate(prompts(*[f"q{i}" for i in range(6)]), SamplingParams(max_tokens=8))
    assert not [r.getMessage() for r in caplog.records], caplog.text
    assert "0.0 MB" not in str(err.value) and " kB more needed" in str(err.value)


def test_a_shortfall_under_a_megabyte_is_said_in_kilobytes(small_disk):
    """It was "about 0.0 MB more needed" for anything under 50 kB."""
    from r2med_agent.io import atomic_write_text

    leave_free(small_disk, 40)
    with pytest.raises(DiskFullError) as err:
        atomic_write_text(small_disk / "out.txt", "y" * 60_000)
    message = str(err.value)
    assert "0.0 MB" not in message and " kB more needed" in message
    needed = int(message.split("(about ")[1].split(" kB")[0])
    assert 10 <= needed <= 30, message
    assert str(DiskFullError("p", 1)).count("about 1 kB") == 1
    assert "about 2.5 MB" in str(DiskFullError("p", 2_500_000))
