"""Defaults are resolved into the run spec (issue 28, item 1): giving an option the value the run
gets without it is the same run, in the same folder, on the same ``compare`` row, served from the
same result. Tried as a new user would, ``--temperature 0.7`` on an LLM whose default is 0.7 made a
second folder and a duplicate row (W/T/L 0/12/0)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.registry import get_llm_spec
from tests.fakes import ScriptedLLM

LLM = "qwen-7b"  # a vLLM entry; the scripted backend stands in for the engine


@pytest.fixture
def scripted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``make_llm`` gives the entry's name over a scripted backend behind a real cache; the list
    counts the prompts the backend was sent."""
    from r2med_agent.llm.cache.wrapper import CachedLLM

    sent: list[int] = []

    def answer(msgs, params):
        sent.append(1)
        return "Passage: fever and cough " + msgs[-1]["content"][-80:]

    def make_llm(name, **_):
        model = get_llm_spec(name).model
        return CachedLLM(ScriptedLLM(answer, model_id=model), model, "plain",
                         GenerationCache(tmp_path / "gen.sqlite"))

    monkeypatch.setattr("r2med_agent.llm.make_llm", make_llm)
    return sent


def _run(out: Path, *extra: str) -> None:
    args = ["run", "--task", "sample", "--method", "hyde", "--llm", LLM, "--prompts", "own", "-o", str(out),
            "--no-progress", *extra]
    assert main(args) == 0


def _rows(out: Path, tmp_path: Path) -> list[list[str]]:
    table = tmp_path / "compare.csv"
    assert main(["compare", str(out), "--format", "csv", "--out", str(table)]) == 0
    rows = list(csv.reader(table.read_text().splitlines()))
    return [r for r in rows[1:] if r and r[0].strip().lower() != "average"]


def test_the_entrys_default_temperature_is_the_run_without_the_option(tmp_path: Path, scripted: list[int]) -> None:
    spec = get_llm_spec(LLM)
    out = tmp_path / "results"
    _run(out)
    first = len(scripted)
    assert first > 0
    _run(out, "--temperature", str(spec.temperature), "--top-p", str(spec.top_p),
         "--max-tokens", str(spec.max_tokens), "--seed", str(spec.seed))
    assert len(scripted) == first  # served from the first run's generations
    folders = sorted(p.relative_to(out).as_posix() for p in out.glob("*/*/*") if p.is_dir())
    assert folders == [f"hyde/{LLM}/bm25"]
    assert len(_rows(out, tmp_path)) == 1
    # Another temperature is another run: its own folder and row.
    _run(out, "--temperature", str(spec.temperature + 0.1))
    assert len(sorted(p for p in out.glob("*/*/*") if p.is_dir())) == 2
    assert len(_rows(out, tmp_path)) == 2
