"""Progress in a terminal and in a log file (issue 20 items 3 and 11): the module with a fake
clock and fake streams, the ``run`` options, and a real ``r2med-agent run`` whose stderr is a
file (slow)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r2med_agent import progress
from r2med_agent.progress import GenerationProgress, StageProgress, log_handler, stage_bar, tracking

_STAMP = r"\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\] "


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Terminal(io.StringIO):
    """A stream that says it is a terminal (so progress draws bars on it)."""

    def isatty(self) -> bool:
        return True


def test_stage_in_a_file_writes_timestamped_lines_at_the_interval_and_no_bar() -> None:
    clock, out = _Clock(), io.StringIO()
    bar = stage_bar(total=100, desc="encode MiniLM (doc)", unit="text", leave=False,
                    stream=out, clock=clock, interval_s=30.0)
    assert isinstance(bar, StageProgress)
    for _ in range(5):  # 50 texts in 25 s: under the interval, nothing yet
        clock.t += 5.0
        bar.update(10)
    assert out.getvalue() == ""
    clock.t += 5.0
    bar.update(10)
    clock.t += 40.0
    bar.update(40)
    bar.close()
    lines = out.getvalue().splitlines()
    assert bar.lines == ["encode MiniLM (doc): 60/100 text (60%), 2.00/s, ETA 0:00:20",
                         "encode MiniLM (doc): 100/100 text (100%), 1.43/s, done in 0:01:10"]
    assert len(lines) == 2 and all(re.match(_STAMP, line) for line in lines)
    assert [re.sub(_STAMP, "", line) for line in lines] == bar.lines
    assert "\r" not in out.getvalue() and "|" not in out.getvalue()


def test_a_short_stage_in_a_file_writes_nothing_and_iterating_counts_items() -> None:
    clock, out = _Clock(), io.StringIO()
    items = list(stage_bar(range(7), desc="BM25 search", unit="query", stream=out, clock=clock))
    assert items == list(range(7)) and out.getvalue() == ""
    bar = stage_bar(range(3), desc="BM25 search", unit="block", stream=out, clock=clock, interval_s=0.0)
    assert list(bar) == [0, 1, 2] and bar.n == 3
    assert [re.sub(_STAMP, "", line) for line in out.getvalue().splitlines()][-1].startswith(
        "BM25 search: 3/3 block (100%)")


def test_stage_on_a_terminal_is_a_bar_and_with_progress_off_nothing() -> None:
    tty = _Terminal()
    bar = stage_bar(total=4, desc="rerank m", unit="pair", leave=False, stream=tty)
    bar.update(4)
    bar.close()
    assert "rerank m" in tty.getvalue() and "\r" in tty.getvalue()
    progress.configure(enabled=False)
    try:
        for stream in (io.StringIO(), _Terminal()):
            quiet = stage_bar(range(2), total=2, desc="x", stream=stream, interval_s=0.0)
            assert list(quiet) == [0, 1] and stream.getvalue() == ""
    finally:
        progress.configure(enabled=True)


def test_generation_lines_in_a_file_carry_the_time() -> None:
    clock, out = _Clock(), io.StringIO()
    p = GenerationProgress(4, "generating (smollm2)", stream=out, interval_s=10.0, show=True, clock=clock)
    clock.t = 10.0
    p.update(1)
    clock.t = 12.0
    p.update(1)  # before the interval: no line until the closing one (issue 39: never the same line twice)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(re.match(_STAMP + r"generating \(smollm2\): \d/4 generations", x) for x in lines)


def test_generation_and_stage_lines_word_for_word() -> None:
    """The plain lines of both kinds: a generation line always counts out of its total (and adds
    the output token rate); a stage without a total shows its count and rate alone."""
    clock = _Clock()
    gen = GenerationProgress(4, "gen (m)", stream=io.StringIO(), show=True, clock=clock)
    clock.t = 10.0
    gen.update(1, tokens=20)
    assert gen.line() == "gen (m): 1/4 generations (25%), 0.10/s, ETA 0:00:30, 2.0 output tok/s"
    clock.t = 20.0
    gen.update(3)
    assert gen.line() == "gen (m): 4/4 generations (100%), 0.20/s, done in 0:00:20, 1.0 output tok/s"
    empty = GenerationProgress(0, "gen (m)", stream=io.StringIO(), show=True, clock=clock)
    assert empty.line() == "gen (m): 0/0 generations, 0.00/s, done in 0:00:00"
    # failed generations are counted apart and the work is never "done" (issue 29 item 8)
    clock.t = 0.0
    failing = GenerationProgress(4, "gen (m)", stream=io.StringIO(), show=True, clock=clock)
    clock.t = 20.0
    failing.update(1)
    failing.fail(1)
    assert failing.line() == "gen (m): 1/4 generations (25%), 1 failed, 0.05/s"
    failing.fail(2)
    assert failing.line() == "gen (m): 1/4 generations (25%), 3 failed, 0.05/s, ended in 0:00:20"
    for total in (None, 0):
        clock.t = 0.0
        stage = StageProgress(total=total, desc="BM25 index", unit="doc", stream=io.StringIO(), clock=clock)
        clock.t = 4.0
        stage.update(10)
        assert stage.line() == "BM25 index: 10 doc, 2.50/s"


def test_one_line_builder_with_and_without_a_total() -> None:
    """Both kinds build their line with ``_line_parts``: a known total gives the percent and the
    ETA or the time taken; ``None`` gives the count and the rate alone, never an ETA."""
    parts = progress._line_parts
    assert parts("scan", 6, None, "block", 3.0) == ["scan: 6 block", "2.00/s"]
    assert parts("scan", 0, None, "block", 0.0) == ["scan: 0 block", "0.00/s"]
    assert parts("scan", 6, 12, "block", 3.0) == ["scan: 6/12 block (50%)", "2.00/s", "ETA 0:00:03"]
    assert parts("scan", 12, 12, "block", 90.0) == ["scan: 12/12 block (100%)", "0.13/s", "done in 0:01:30"]
    assert parts("scan", 0, 12, "block", 5.0) == ["scan: 0/12 block (0%)", "0.00/s"]


def test_generation_bar_is_drawn_once_the_backend_is_ready_not_while_it_loads() -> None:
    """Item 11: a ``0/10`` bar drawn before the model loaded stayed on screen, and the
    loading message printed into it."""
    tty = _Terminal()
    with tracking(10, "generating (m)", stream=tty, show=True) as p:
        assert tty.getvalue() == ""  # the backend is loading: no bar yet
        p.ready()
        assert "generating (m)" in tty.getvalue()
        p.update(10)


def test_a_log_record_goes_above_the_bar_not_into_it() -> None:
    from tqdm import tqdm

    tty = _Terminal()
    logger = logging.getLogger("r2med_agent.tests.progress")
    handler = log_handler(tty)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        bar = tqdm(total=10, desc="generating (m)", file=tty, leave=False)
        logger.warning("loading backend for m")
        bar.close()
    finally:
        logger.removeHandler(handler)
    text = tty.getvalue()
    before = text[: text.index("loading backend")]
    assert before.endswith("\r")  # the bar was cleared first: the message starts its own line
    assert "loading backend for m\n" in text


def test_configure_refuses_a_negative_interval() -> None:
    from r2med_agent.errors import ConfigError

    with pytest.raises(ConfigError, match="progress interval"):
        progress.configure(interval_s=-1)


def test_run_help_says_progress_is_on_with_lines_in_a_file() -> None:
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "400"}).output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())
    assert "a timestamped line every --progress-interval seconds" in text, text
    assert "only when standard error is a terminal" not in text


def test_run_on_sample_with_stderr_in_a_file_writes_progress_lines(tmp_path: Path) -> None:
    """The default (no --progress): BM25's search shows as plain lines in a piped log."""
    log = tmp_path / "run.log"
    with log.open("w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "-o", str(tmp_path / "out"),
             "--progress-interval", "0"],
            stdout=subprocess.PIPE, stderr=err, text=True, timeout=300,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    assert re.search(_STAMP + r"BM25 (search|analyze): \d+/\d+ ", text), text
    assert "\r" not in text and "%|" not in text


@pytest.mark.slow
def test_real_local_generation_with_stderr_in_a_file(tmp_path: Path, smollm2_gguf: Path) -> None:
    """Item 3: a real ``r2med-agent run`` of HyDE with SmolLM2 on llama.cpp, stderr a file,
    no progress option: timestamped generation lines, and never a bar."""
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    log = tmp_path / "run.log"
    with log.open("w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--method", "hyde",
             "--llm", "smollm2", "--max-tokens", "16", "-o", str(tmp_path / "out"),
             "--progress-interval", "0"],
            stdout=subprocess.PIPE, stderr=err, env=env, text=True, timeout=900,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    generated = re.findall(_STAMP + r"generating \(.*smollm2.*\): (\d+)/12 generations", text)
    assert [int(n) for n in generated][-1] == 12 and len(generated) >= 2, text
    assert "done in" in text
    assert "\r" not in text and "%|" not in text and "it/s]" not in text


def test_each_sample_s_progress_says_which_sample_it_counts(tmp_path: Path, capsys) -> None:
    """Item 11: ``--samples 8`` on a backend that draws one sample per call showed eight
    identical bars."""
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.types import SamplingParams
    from tests.fakes import ScriptedLLM

    llm = CachedLLM(ScriptedLLM(lambda m, p: "text", model_id="m"), "m", "plain", GenerationCache(tmp_path / "g.sqlite"))
    progress.configure(interval_s=1e9)
    try:
        llm.generate_samples([[{"role": "user", "content": f"q{i}"}] for i in range(2)], SamplingParams(seed=1), 3)
    finally:
        progress.configure(interval_s=progress.PLAIN_INTERVAL_S)
    done = [re.sub(_STAMP, "", line) for line in capsys.readouterr().err.splitlines() if "generations" in line]
    assert [line.split(":")[0] for line in done] == [f"generating (m) sample {s}/3" for s in (1, 2, 3)]


def _screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: carriage returns, line feeds and tqdm's cursor-up."""
    rows: list[list[str]] = [[]]
    r = c = i = 0
    while i < len(text):
        if text.startswith("\x1b[A", i):
            r, i = max(r - 1, 0), i + 3
            continue
        ch, i = text[i], i + 1
        if ch == "\r":
            c = 0
        elif ch == "\n":
            r, c = r + 1, 0
        else:
            while len(rows) <= r:
                rows.append([])
            rows[r].extend(" " * (c + 1 - len(rows[r])))
            rows[r][c], c = ch, c + 1
    return ["".join(x).rstrip() for x in rows]


def _shards_with_a_load_message(handler: logging.Handler, tty: _Terminal) -> list[str]:
    """The corpus bar, the encoder's loading message, then the first shard's bar (MiniLM)."""
    logger = logging.getLogger("r2med_agent.tests.shards")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        outer = stage_bar(total=2000, desc="corpus shards", unit="doc", stream=tty)
        logger.warning("loaded encoder minilm on cpu in 0.4 s")
        inner = stage_bar(total=1000, desc="encode minilm (doc)", unit="text", leave=False, stream=tty)
        inner.update(500)
        outer.refresh()
        screen = _screen(tty.getvalue())
        inner.close()
        outer.close()
        return screen
    finally:
        logger.removeHandler(handler)


def test_the_overall_bar_stays_above_the_shard_bar_when_a_message_is_logged() -> None:
    """Item 11: a message logged while the corpus bar was drawn (the encoder loading in the first
    shard) printed into the bar line, and the shard's bar ended up above the overall one."""
    tty = _Terminal()
    screen = _shards_with_a_load_message(log_handler(tty), tty)

    def row(needle: str) -> int:
        return next(i for i, line in enumerate(screen) if needle in line)

    assert row("loaded encoder minilm") < row("corpus shards") < row("encode minilm (doc)"), screen
    assert not any("loaded encoder" in line and "|" in line for line in screen), screen


def test_work_that_finishes_after_an_interrupt_writes_no_line_after_the_last() -> None:
    """Issue 39 item 18: after Ctrl-C a progress line printed twice (a real llama.cpp run in a log
    file, interrupted after its second generation: "2/5 generations (40%) ... ETA" twice, the
    interval line and the closing line). The closing line is left out when it would say what the
    last line said; and a closed progress counts what still finishes (an HTTP batch's workers)
    but writes nothing more, in a log file as on a terminal."""
    clock, out = _Clock(), io.StringIO()
    cut = GenerationProgress(5, "generating (m)", stream=out, interval_s=0.0, show=True, clock=clock)
    clock.t = 20.0
    cut.update(1)
    clock.t = 36.0
    cut.update(1)
    cut.close()  # Ctrl-C right after the second line
    assert [line.split(": ", 1)[1][:25] for line in cut.lines] == ["1/5 generations (20%), 0.", "2/5 generations (40%), 0."]
    assert len(out.getvalue().splitlines()) == 2
    stage_cut = StageProgress(total=10, desc="encode", unit="text", stream=out, interval_s=0.0, clock=clock)
    stage_cut.update(3)
    stage_cut.close()
    assert len(stage_cut.lines) == 1

    clock, out = _Clock(), io.StringIO()
    gen = GenerationProgress(10, "generating (m)", stream=out, interval_s=10.0, show=True, clock=clock)
    clock.t = 10.0
    gen.update(3)  # a line at the interval
    clock.t = 15.0
    gen.update(1)
    clock.t = 25.0
    gen.close()  # the interrupt: the last line
    clock.t = 40.0
    gen.update(1)
    gen.fail(1)
    assert gen.n == 5 and gen.failed == 1
    assert len(out.getvalue().splitlines()) == 2 and len(gen.lines) == 2

    stage_out = io.StringIO()
    stage = StageProgress(total=100, desc="encode", unit="text", stream=stage_out, interval_s=10.0, clock=clock)
    clock.t += 10.0
    stage.update(10)
    stage.update(5)
    stage.close()
    clock.t += 30.0
    stage.update(10)
    assert stage.n == 25 and len(stage_out.getvalue().splitlines()) == 2

    term = _Terminal()
    bar = GenerationProgress(10, "generating (m)", stream=term, show=True, clock=clock)
    bar.update(2)
    bar.close()
    after = term.getvalue()
    bar.update(1)
    bar.fail(1)
    assert term.getvalue() == after  # nothing drawn after the bar is gone
