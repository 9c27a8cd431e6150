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
