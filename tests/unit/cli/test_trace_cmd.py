"""``trace show``: the header of each trajectory is whole at any width."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner


def _trace_file(tmp_path: Path) -> Path:
    record = {
        "query_id": "PMC-Clinical-query-000123", "method": "search-o1", "finish_reason": "max_turns",
        "final": "an answer",
        "steps": [{"generated": "thinking", "search_query": "q", "doc_ids": ["d1"], "inserted": "doc",
                   "prompt_tokens": 123456, "completion_tokens": 7890}] * 3,
        "extra": {"task": "PMC-Clinical", "searches": ["q", "q", "q"]},
    }
    path = tmp_path / "PMC-Clinical.traces.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return path


def test_trace_show_header_is_not_cut_at_80_columns(tmp_path: Path) -> None:
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    res = CliRunner().invoke(app, ["trace", "show", str(_trace_file(tmp_path))], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    text = " ".join(res.output.split())
    assert ("search-o1 · query PMC-Clinical-query-000123 (PMC-Clinical) · finish: max_turns · 3 steps · "
            "searches: 3 · tokens 370368 in / 23670 out") in text
    assert "…" not in res.output.split("step 1")[0]


def test_trace_show_takes_the_result_folder(tmp_path: Path) -> None:
    """Issue 30 item 8: `trace show <result folder>` shows the trajectories of every task in it
    (``--task`` picks some); a folder above the result folders names those that have traces."""
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    folder = tmp_path / "results" / "search-o1" / "smollm2" / "bm25"
    folder.mkdir(parents=True)
    _trace_file(folder)
    second = json.loads((folder / "PMC-Clinical.traces.jsonl").read_text())
    second.update(query_id="bio-7", extra={"task": "Biology", "searches": []})
    (folder / "Biology.traces.jsonl").write_text(json.dumps(second) + "\n", encoding="utf-8")
    runner = CliRunner()
    res = runner.invoke(app, ["trace", "show", str(folder)], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    assert "query bio-7" in res.output and "query PMC-Clinical-query-000123" in res.output
    assert res.output.index("Biology (") < res.output.index("PMC-Clinical (")
    assert "2 trajectories; finish reasons: max_turns 2" in res.output
    res = runner.invoke(app, ["trace", "show", str(folder), "--task", "Biology"], env={"COLUMNS": "120"})
    assert res.exit_code == 0 and "bio-7" in res.output and "PMC-Clinical-query" not in res.output
    res = runner.invoke(app, ["trace", "show", str(tmp_path / "results")], env={"COLUMNS": "200"})
    assert res.exit_code != 0
    assert f"folders below it that have them: {folder}" in " ".join(str(res.exception).split())


def test_the_documented_trace_show_commands_run_on_string_query_ids(tmp_path: Path) -> None:
    """Issue 39 item 18: docs/agentic.md showed ``trace show FILE --query 0``, which fits no
    trace file whose ids are strings. Each documented ``trace show`` line runs here on a traces
    file of BRIGHT-style string ids (the file for the documented path, an id of it for the
    documented placeholder)."""
    import shlex

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    folder = tmp_path / "results" / "search-o1" / "smollm2" / "bm25"
    folder.mkdir(parents=True)
    record = json.loads(_trace_file(folder).read_text())
    record.update(query_id="biology-12", extra={"task": "Biology", "searches": []})
    traces = folder / "Biology.traces.jsonl"
    traces.write_text(json.dumps(record) + "\n", encoding="utf-8")
    docs = (Path(__file__).resolve().parents[3] / "docs" / "agentic.md").read_text(encoding="utf-8")
    lines = [line.split("#")[0] for line in docs.splitlines() if line.startswith("r2med-agent trace show")]
    assert any("--query" in line for line in lines)
    for line in lines:
        args = shlex.split(line)[1:]
        args = [str(traces) if a.endswith(".traces.jsonl") else str(folder) if a.startswith("results/") else a
                for a in args]
        args = ["biology-12" if a.startswith("<") else a for a in args]
        res = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
        assert res.exit_code == 0, (line, res.output, res.exception)
        assert "query biology-12" in res.output
