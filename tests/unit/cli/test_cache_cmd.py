"""``cache export``: when a selection holds several configurations, each listed group shows
what sets it apart (issue 20 item 11)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from r2med_agent.errors import DataError
from r2med_agent.llm.cache.store import GenerationCache
from r2med_agent.llm.cache.transfer import ExportSelection, export_r2med
from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.types import SamplingParams
from tests.fakes import ScriptedLLM


def test_groups_that_differ_beyond_sampling_print_differently(tmp_path: Path) -> None:
    """A loop's first turn ends with the user's message, a continued turn with the assistant's:
    two request-settings groups whose sampling, model and template are equal."""
    llm = CachedLLM(ScriptedLLM(lambda m, p: "text", model_id="fake-model"), "fake-model", "plain",
                    GenerationCache(tmp_path / "g.sqlite"))
    meta = [{"task": "T", "query_id": "1", "method": "search-r1"}]
    params = SamplingParams(seed=1)
    llm.generate([[{"role": "user", "content": "q"}]], params, meta=meta, template_hash="tpl")
    llm.generate([[{"role": "user", "content": "q"}, {"role": "assistant", "content": "so far"}]], params,
                 meta=meta, template_hash="tpl")
    with pytest.raises(DataError, match="2 different request settings") as err:
        export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", method="search-r1"))
    groups = [line for line in str(err.value).splitlines() if line.startswith("  ")]
    assert len(groups) == 2
    # Without the hash and the time, the two lines still differ, by the setting that differs.
    shown = {re.sub(r"^\s+\S+|newest .*$", "", line) for line in groups}
    assert len(shown) == 2, groups
    assert any("final_assistant=" in line for line in groups), groups
