"""Results of ``diver-4b`` made before it embedded DIVER's raw queries (``encoder_rules`` 1: it
prepended the web-search instruction, now ``diver-4b-instructed``) are another run: a record such a
version wrote (it lacks ``encoder_rules``) reads back with its own spec, folder and ``compare`` row,
is stale for ``reproduce``, is refused as another spec's by a new run and is migrated to its own
folder; runs with other encoders read as before.

The old trees are what this version writes with the one field it added taken out of every record,
which is what the version before it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.api import build_table, load_results
from r2med_agent.errors import ConfigError
from r2med_agent.experiment.command import cli_args
from r2med_agent.experiment.resolve import applicable, resolve_spec, spec_of_config
from r2med_agent.experiment.spec import ENCODER_RULES, RunSpec
from r2med_agent.experiment.store import ResultStore
from r2med_agent.api import ReproduceOptions, load_grid, plan
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from r2med_agent.api import RunConfig
from tests.result_trees import GOOD, write_result


def _old(spec: RunSpec) -> RunSpec:
    """The spec a record of ``spec`` written before ``encoder_rules`` reads back as."""
    record = spec.record()
    assert record.pop("encoder_rules") == ENCODER_RULES == 2
    return spec_of_config(record)


def test_only_diver_4b_changed_its_settings() -> None:
    assert get_encoder_spec("diver-4b").encoder_rules == 2
    for name in ("diver-4b-instructed", "diver-4b-reasonembed", "minilm", "reasonembed-qwen3-8b"):
        assert get_encoder_spec(name).encoder_rules == 1, name


@pytest.mark.parametrize("spec", [
    RunSpec(retriever="diver-4b"),
    RunSpec(retriever="diver-4b", reranker="grouprank-32b", rerank_k=100),
    RunSpec(retriever="diver-4b+reasonembed-qwen3-8b"),
    RunSpec(method="search-o1", llm="qwen3-32b", retriever="bm25", loop_retriever="diver-4b"),
    RunSpec(method="lamer", llm="qwen-7b", retriever="bm25", first_pass="diver-4b"),
], ids=["alone", "reranked", "fused", "loop", "first-pass"])
def test_a_diver_4b_record_without_encoder_rules_is_of_the_instructed_queries(spec: RunSpec) -> None:
    new = resolve_spec(spec)
    assert RunSpec.from_record(new.record()) == new and "encoder_rules" in applicable(new)
    old = _old(new)
    assert old.encoder_rules == 1 and old.key() != new.key() and old.folder() != new.folder()
    assert "encoders-v1" in old.leaf and "encoder_rules=1" in old.label and RunSpec.from_key(old.key()) == old
    with pytest.raises(ConfigError, match="encoder_rules 1 names results of an earlier version's encoder entries"):
        cli_args(old)


def test_other_encoders_old_records_keep_their_spec_and_folder() -> None:
    for spec in (RunSpec(), RunSpec(retriever="diver-4b-instructed"), RunSpec(retriever="diver-4b-reasonembed"),
                 RunSpec(retriever="minilm", reranker="monobert"), RunSpec(method="hyde", llm="qwen-7b")):
        new = resolve_spec(spec)
        assert _old(new) == new and _old(new).folder() == new.folder()
        assert "encoder_rules" not in applicable(new)
    assert resolve_spec(RunSpec(retriever="minilm", encoder_rules=1)) == resolve_spec(RunSpec(retriever="minilm"))
    with pytest.raises(ConfigError, match="this version runs only encoder_rules 2"):
        RunConfig(tasks=("sample",), retriever="diver-4b", encoder_rules=1)
    with pytest.raises(ConfigError, match="encoder_rules must be an encoder version from 1 to 2"):
        RunSpec(retriever="diver-4b", encoder_rules=3)


def _old_tree(root: Path) -> Path:
    leaf = write_result(root, "none", "none", "diver-4b", "Biology", GOOD)
    record = json.loads((leaf / "Biology.json").read_text())
    assert record["config"].pop("encoder_rules") == ENCODER_RULES
    (leaf / "Biology.json").write_text(json.dumps(record))
    return leaf


def test_an_old_diver_4b_result_reads_back_as_its_own_run(tmp_path: Path, capsys) -> None:
    root = tmp_path / "results"
    folder = _old_tree(root)
    assert folder == root / "none" / "none" / "diver-4b"  # the folder a new run of diver-4b gets
    before = (folder / "Biology.json").read_bytes()
    (row,) = build_table(load_results([root]), "ndcg_at_10").rows
    assert row.row.label == "none/none/diver-4b [encoder_rules=1]"
    # reproduce: stale, runs again.
    (entry,) = [p for p in plan(load_grid("frontier"), ReproduceOptions(output_dir=root, tasks=("Biology",)))
                if p.entry.label == "none/none/diver-4b"]
    assert entry.stale == {"Biology": f"encoder_rules 1, the entry {ENCODER_RULES}"}
    # A new run never writes over it.
    new = RunConfig(tasks=("Biology",), retriever="diver-4b").spec()
    with pytest.raises(ConfigError, match=r"results migrate") as err:
        ResultStore(root).prepare(new)
    assert "encoder_rules=1" in str(err.value) and (folder / "Biology.json").read_bytes() == before
    # Migrated to its own folder, with its own numbers.
    assert main(["results", "migrate", str(root)]) == 0
    assert "1 task result(s) moved" in capsys.readouterr().out
    old = _old(new)
    target = root / old.folder()
    assert target.name.startswith("diver-4b__encoders-v1__") and (target / "Biology.json").read_bytes() == before
    assert ResultStore(root).prepare(new) == folder
