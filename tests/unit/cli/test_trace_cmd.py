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
    from r2med_agent.cli.app import _register, app

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
    from r2med_agent.cli.app import _register, app

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
