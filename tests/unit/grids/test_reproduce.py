"""reproduce: the grids against the published CSV, --dry-run listings and needs, skipping finished
work, and one real run through the runner."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from r2med_agent import api as rep
from r2med_agent.grids import planner
from r2med_agent.grids.grid import RUN_ARGS
from r2med_agent.experiment.resolve import Registries
from r2med_agent.grids.needs import entry_needs, load_models, weights_gib
from r2med_agent.grids.planner import task_option
from r2med_agent.analysis.results import r2med_tasks
from r2med_agent.api import PublishedKey, published_results
from r2med_agent.experiment.resolve import resolve_spec
from r2med_agent.errors import ConfigError
from r2med_agent.experiment.spec import SAMPLING_FLAGS, SPEC_FLAGS, RunSpec
from r2med_agent.paths import resources_dir
from r2med_agent.api import TABLES, ReproduceOptions, format_plan, load_grid, load_grids, plan, reproduce
from tests.result_trees import QRELS, ranking, write_r2med_task, write_result

RUN = {"q1": ranking("d1", "d5"), "q2": ranking("d8", "d2"), "q3": ranking("d3"), "q4": ranking("d9")}


def write_rerank_result(out: Path, task: str, reranker: str, config: dict | None = None) -> Path:
    """A result of the rerank grid's setting: NV-Embed-v2's top 10 (the query's own id left out, as
    BEIR's search did) reranked and kept."""
    return write_result(out, "none", "none", "nv__top10", task, RUN, QRELS, reranker=reranker,
                        config={"retriever": "nv", "rerank_k": 10, "rerank_cut": True, "exclude_identical_ids": True,
                                **(config or {})})


@pytest.fixture()
def cli():
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    return app


def csv_ndcg() -> dict[tuple[str, str, str, str], dict[str, float]]:
    out: dict[tuple[str, str, str, str], dict[str, float]] = {}
    with (resources_dir() / "published_results.csv").open(encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            out.setdefault((r["method"], r["llm"], r["retriever"], r["reranker"]), {})[r["task"]] = float(r["ndcg_at_10"])
    return out


def test_grids_cover_every_published_configuration_exactly_once():
    grids = dict(load_grids())
    assert set(grids) == set(TABLES)
    grids.pop("beyond")  # not a reproduction: unpublished configurations beside the best row
    frontier = grids.pop("frontier")  # published since the paper: checked below
    for bright in ("bright", "bright-long", "bright-frontier"):  # tests/unit/analysis/test_bright_published.py
        grids.pop(bright)
    pub = published_results()
    assert {t: len(g.entries) for t, g in grids.items()} == {
        "retrievers": 15, "gar": 45, "agentic": 8, "rerank": 3, "nano": 5
    }
    keys = [e.published_key for t, g in grids.items() if t != "nano" for e in g.entries]
    assert len(keys) == len(set(keys)) == 71
    kinds = published_results().kinds
    # The nano grid holds each of the card's three profiles, computed and as shipped.
    nano = {e.published_key for e in grids["nano"].entries}
    assert {kinds[k] for k in nano} == {"nano"} and len(nano) == 3
    assert set(keys) | nano == {k for k in pub.keys() if pub.kind(k) not in (None, "frontier")}
    # Each frontier entry is one published configuration, but for DIVER's code since its fix
    # (diver-4b-instructed), another reading of the first stage behind 42.9 shown beside it; those
    # it cannot run are named.
    fkeys = {e.published_key for e in frontier.entries}
    assert {kinds[k] for k in fkeys} == {"frontier"} and len(fkeys) == len(frontier.entries) - 1
    shared = [e.label for e in frontier.entries if e.published_key == PublishedKey("none", "", "diver-4b", "")]
    assert shared == ["none/none/diver-4b", "none/none/diver-4b-instructed"]
    not_run = {k for k in pub.keys("frontier") if pub.kind(k) == "frontier"} - fkeys
    assert {k.reranker or k.retriever for k in not_run} == {"rank-k-32b", "erank-32b"}
    assert {kinds[e.published_key] for e in grids["retrievers"].entries} == {"retrieval"}
    assert {kinds[e.published_key] for e in grids["rerank"].entries} == {"rerank"}
    assert {e.method for e in grids["agentic"].entries} == {"search-r1", "search-o1"}
    assert {e.method for e in grids["gar"].entries} == {"hyde", "query2doc", "lamer"}


def test_grid_scores_are_the_csv_scores():
    # Read both files directly (not through the loader, which checks the same): every entry's
    # ndcg_at_10 in configs/reproduce/*.yaml equals the packaged CSV's row of its published name.
    import yaml

    from r2med_agent.paths import configs_dir

    expected = csv_ndcg()
    n = 0
    frontier = published_results()
    expected.update({(k.method, k.llm, k.retriever, k.reranker): frontier.scores(k) for k in frontier.keys("frontier")})
    for table in TABLES:
        if table == "frontier" or table.startswith("bright"):  # scores: published (test_frontier.py,
            continue  # test_bright_published.py)
        doc = yaml.safe_load((configs_dir() / "reproduce" / f"{table}.yaml").read_text(encoding="utf-8"))
        for e in doc["entries"]:
            pub = e.get("published") or {}
            key = tuple(pub.get(k, e.get(k, "")) for k in ("method", "llm", "retriever", "reranker"))
            assert e["ndcg_at_10"] == expected[key], (table, key)
            # written in the task order of the grid's group (the paper's, or NanoR2MED's)
            assert list(e["ndcg_at_10"]) == list(load_grid(table).tasks)
            n += 1
    assert n == 71 + 5 + 9  # the reproduction grids, nano, and the beyond grid beside the best rows
    # The loader hands the same numbers on.
    for name, grid in load_grids().items():
        for entry, scores in zip(grid.entries, grid.published):
            assert scores == entry.ndcg_at_10 or name == "frontier" or name.startswith("bright")


def _needs(entry, generations="fresh", **kw):
    """``entry_needs`` of a grid entry with its row's plan (as ``reproduce`` makes it)."""
    cfg = entry.run_config(("Biology",), Path("results"), generations=generations)
    return entry_needs(entry, cfg.plan, generations=generations, **kw)


def test_every_grid_model_is_in_the_registries_and_sized():
    models = load_models()
    for grid in load_grids().values():
        for entry in grid.entries:
            needs = _needs(entry, datasets=["R2MED/Biology"], models=models)
            assert needs.problems == (), (entry.label, needs.problems)


def test_dry_run_lists_every_entry(cli, tmp_path):
    out = tmp_path / "out"
    runner = CliRunner()
    for table, grid in load_grids().items():
        res = runner.invoke(cli, ["reproduce", "--table", table, "--dry-run", "--output-dir", str(out)])
        assert res.exit_code == 0, res.output
        for i, entry in enumerate(grid.entries):
            cmd = entry.command(task_option(grid.tasks), out, generations=entry.generations_mode())
            assert f"    {cmd}\n" in res.output
            who = "published" if grid.averages[i] is not None else "paper"
            assert f"[{i}] {entry.label}  (to run; {who} nDCG@10 avg " in res.output
        n = len(grid.entries)
        assert f"{n} configuration(s): {n} to run, 0 already done" in res.output
        assert "PROBLEM" not in res.output
    assert not out.exists()  # a dry run writes nothing


def test_dry_run_commands_and_needs(tmp_path):
    grids = load_grids()
    opts = ReproduceOptions(output_dir=tmp_path)

    def find(table, label):
        return next(p for p in plan(grids[table], opts) if p.entry.label == label)

    p = find("gar", "hyde/qwen-72b/bm25-compat")
    # R2MED released these generations: scored from its files, no LLM, no GPU.
    # R2MED's scripts use an empty generation as it is (gar.yaml's args); BM25 excludes no ids.
    assert p.command == (
        f"r2med-agent run --method hyde --llm qwen-72b --generations r2med --retriever bm25-compat "
        f"--empty-generation keep --task all --output-dir {tmp_path}"
    )
    kept = resolve_spec(RunSpec(method="hyde", llm="qwen-72b", generations="r2med", retriever="bm25-compat", empty_generation="keep"))
    assert p.generations == "r2med" and p.result_dir == tmp_path / "hyde" / "qwen-72b@r2med" / kept.leaf
    assert kept.leaf == f"bm25-compat__empty-keep__{kept.digest()}"
    assert p.needs.gpu == () and p.needs.setup[0].startswith(
        "generations: released by R2MED (hyde/qwen-72b/query_with_hydoc.jsonl of each task")
    fresh = next(x for x in plan(grids["gar"], ReproduceOptions(output_dir=tmp_path, generations="fresh"))
                 if x.entry.label == "hyde/qwen-72b/bm25-compat")
    # fresh vLLM generations render the chat template for LLM.generate, as R2MED's script did
    assert fresh.command == (
        f"r2med-agent run --method hyde --llm qwen-72b --retriever bm25-compat --empty-generation keep "
        f"--llm-prompt rendered --task all --output-dir {tmp_path}"
    )
    assert fresh.needs.setup == ("generations: fresh with qwen-72b (--generations fresh)",)
    # 72.7e9 params * 2 bytes = 135.4 GiB; llms.yaml runs it on 4 GPUs: 33.9 GiB each.
    assert weights_gib(72.7) == pytest.approx(135.41, abs=0.01)
    assert fresh.needs.gpu == ("LLM qwen-72b ≈135.4 GiB bf16 weights, tensor-parallel 4 -> ≈33.9 GiB/GPU + KV cache",)
    p = fresh
    assert p.needs.api_keys == ()
    assert p.needs.hub[0] == "Qwen/Qwen2.5-72B-Instruct (weights)"
    assert p.needs.hub[1].startswith("datasets R2MED/Biology, R2MED/Bioinformatics")
    assert p.published_average == pytest.approx(sum(p.published.values()) / 8)

    gpt = find("gar", "query2doc/gpt4/nv")
    assert gpt.needs.api_keys == () and find("gar", "query2doc/gpt4/nv").generations == "r2med"
    assert gpt.needs.gpu == ("encoder nv ≈14.6 GiB fp16 weights",)
    assert gpt.needs.setup[1] == (
        "retriever nv: nvidia/NV-Embed-v2 in fp16; needs transformers==4.42.4, best in a separate environment "
        "(the run stops with the pip command otherwise)"
    )
    assert find("retrievers", "none/none/voyage").needs.api_keys == ("VOYAGE_API_KEY",)
    assert "GPU: none (CPU only)" in find("retrievers", "none/none/bm25-compat").needs.lines()
    fresh_plan = {x.entry.label: x for x in plan(grids["gar"], ReproduceOptions(output_dir=tmp_path, generations="fresh"))}
    assert fresh_plan["query2doc/gpt4/nv"].needs.api_keys == ("OPENAI_API_KEY",)
    assert "gated" in fresh_plan["hyde/llama-70b/bm25-compat"].needs.hub[0]
    # LameR's first pass is the reference's BM25 when it generates; released rows need none.
    lamer = fresh_plan["lamer/qwen-7b/bge"]
    assert "--first-pass bm25-compat" in lamer.command and "LameR first pass: bm25-compat top 10" in lamer.needs.setup
    assert "--first-pass" not in find("gar", "lamer/qwen-7b/bge").command
    # Rerankers: NV-Embed-v2's top 10 reranked and kept, as the published files were made.
    rank = find("rerank", "none/none/nv/rankllama")
    assert rank.command.endswith(f"--reranker rankllama --rerank-k 10 --rerank-cut --exclude-identical-ids "
                                 f"--task all --output-dir {tmp_path}")
    rank_spec = resolve_spec(RunSpec(retriever="nv", reranker="rankllama", rerank_k=10, rerank_cut=True, exclude_identical_ids=True))
    assert rank.result_dir == tmp_path / rank_spec.folder()
    assert rank.result_dir.name == f"nv__top10__noself__rankllama__{rank_spec.digest()}"
    assert "reranker rankllama in fp16: re-scores the top 10 of nv and keeps only those 10" in rank.needs.setup
    assert "meta-llama/Llama-2-7b-hf" in rank.needs.hub[1]
    # Agentic rows: Search-R1's released generations; Search-o1 with Qwen3 was not released.
    agentic = {x.entry.label: x for x in plan(grids["agentic"], opts)}
    assert agentic["search-r1/qwen-3b-ins/bge"].generations == "r2med"
    assert agentic["search-o1/qwen3-32b/nv"].generations == "fresh"
    assert "generations: fresh with qwen3-32b (R2MED released none for this row)" in agentic["search-o1/qwen3-32b/nv"].needs.setup
    # With a local copy no dataset comes from the hub; a smaller GPU flags what does not fit.
    local = plan(grids["gar"], ReproduceOptions(output_dir=tmp_path, data_dir=tmp_path / "d", gpu_gib=24))
    big = next(x for x in local if x.entry.label == "hyde/qwen-72b/nv")
    assert not any(h.startswith("datasets") for h in big.needs.hub)
    assert big.needs.gpu == ("encoder nv ≈14.6 GiB fp16 weights",)  # released generations: no LLM
    nv = next(x for x in plan(grids["retrievers"], ReproduceOptions(output_dir=tmp_path, gpu_gib=16)) if x.entry.label == "none/none/nv")
    assert nv.needs.gpu[0].endswith("(does not fit one 16 GiB GPU)")
    assert "--data-dir" in big.command


def test_dry_run_adds_up_an_llm_and_an_encoder_on_one_gpu(tmp_path):
    grid = load_grid("gar")
    entry = next(e for e in grid.entries if e.label == "hyde/qwen-7b/nv")
    # qwen-7b: 7.6e9 * 2 B = 14.16 GiB; nv: 7.85e9 * 2 B = 14.62 GiB; with a fifth more: 34.5 GiB.
    # llms.yaml runs qwen-7b with gpu_memory_utilization 0.85: vLLM leaves 12.0 GiB of 80, less
    # than nv's 17.5; 0.78 of the GPU leaves it room.
    assert entry.generations_mode() == "r2med" and _needs(entry, generations="r2med").gpu == (
        "encoder nv ≈14.6 GiB fp16 weights",)
    needs = _needs(entry)
    assert needs.gpu[2] == (
        "together (estimate, if resident at once): ≈14.2 GiB LLM share + ≈14.6 GiB encoder/reranker "
        "weights, ≈34.5 GiB with a fifth for activations and KV cache; vLLM reserves 85% of the GPU "
        "(gpu_memory_utilization), leaving ≈12.0 GiB: set it to at most 0.78 in the LLM's registry entry"
    )
    small = _needs(entry, gpu_gib=24)
    assert small.gpu[2].endswith("≈34.5 GiB with a fifth for activations and KV cache (does not fit one 24 GiB GPU)")
    # One model on the GPU: no sum.
    alone = next(e for e in grid.entries if e.label == "hyde/qwen-7b/bm25-compat")
    assert len(_needs(alone).gpu) == 1


def test_finished_work_is_skipped_and_partial_work_resumed(tmp_path, monkeypatch):
    grid = load_grid("rerank")
    out = tmp_path / "results"
    tasks = r2med_tasks()
    first, second, third = grid.entries
    for t in tasks:
        write_rerank_result(out, t, first.reranker)
    write_rerank_result(out, "Biology", second.reranker)
    opts = ReproduceOptions(output_dir=out)
    listing = format_plan(plan(grid, opts))
    assert f"[0] {first.label}  (done;" in listing
    assert f"[1] {second.label}  (partial;" in listing
    assert "done: Biology; runs: Bioinformatics" in listing
    assert f"[2] {third.label}  (to run;" in listing

    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(planner, "_run_one", lambda entry, o, t: calls.append((entry.label, tuple(t))))
    table = reproduce(grid, opts)
    assert calls == [(second.label, tasks[1:]), (third.label, tasks)]
    # The closing table: the grid's finished rows with the paper's numbers beside them.
    # (rows are named by their run specs: NV-Embed-v2's top 10 reranked and kept)
    assert [r.row.label for r in table.rows] == [
        f"none/none/nv/{e.reranker} [rerank_k=10, rerank_cut=true, exclude_identical_ids=true]" for e in (first, second)
    ]
    expected = csv_ndcg()[("none", "", "nv", "monobert")]
    assert table.rows[0].published == expected
    assert table.rows[1].missing_tasks == tasks[1:]
    assert table.rows[1].published_average == csv_ndcg()[("none", "", "nv", "bge-reranker")]["Biology"]


def _grid(tmp_path: Path, *entries: str) -> rep.Grid:
    path = tmp_path / "grid.yaml"
    path.write_text("title: t\nentries:\n" + "".join(f"  - {e}\n" for e in entries))
    return load_grid(path)


def test_results_made_with_other_settings_are_stale_and_run_again(tmp_path, monkeypatch, cli):
    grid = load_grid("rerank")
    out = tmp_path / "results"
    first = grid.entries[0]  # monobert over nv's top 10, kept alone
    for t in r2med_tasks():
        write_rerank_result(out, t, "monobert")
    # Same folder, other settings: reranked the top 100; scored at depth 50.
    write_rerank_result(out, "Biology", "monobert", config={"rerank_k": 100})
    write_rerank_result(out, "MedQA-Diag", "monobert", config={"top_k": 50})
    opts = ReproduceOptions(output_dir=out)
    p = plan(grid, opts)[0]
    assert p.stale == {"Biology": "rerank_k 100, the entry 10", "MedQA-Diag": "top_k 50, the entry 100"}
    assert p.pending == ("Biology", "MedQA-Diag")
    listing = format_plan(plan(grid, opts))
    assert f"[0] {first.label}  (stale;" in listing
    assert "    stale Biology (runs again): rerank_k 100, the entry 10\n" in listing
    assert "3 configuration(s): 3 to run (1 with stale results), 0 already done" in listing
    res = CliRunner().invoke(cli, ["reproduce", "--table", "rerank", "--dry-run", "--output-dir", str(out)])
    assert res.exit_code == 0 and "(stale;" in res.output and "top_k 50, the entry 100" in res.output
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr(planner, "_run_one", lambda entry, o, t: calls.append((entry.label, tuple(t))))
    reproduce(grid, opts)
    assert calls[0] == (first.label, ("Biology", "MedQA-Diag"))


def test_staleness_compares_only_the_settings_that_apply(tmp_path):
    out = tmp_path / "results"
    opts = ReproduceOptions(output_dir=out, tasks=("Biology",))
    grid = _grid(tmp_path, "{method: none, retriever: bm25}")
    # rerank_k means nothing without a reranker; loop_retriever and final nothing without a loop.
    # This version never records them so; an earlier one (before rerank_rules) did.
    leaf = write_result(out, "none", "none", "bm25", "Biology", RUN, config={"rerank_k": 10, "loop_retriever": "nv"})
    rec = json.loads((leaf / "Biology.json").read_text())
    del rec["config"]["rerank_rules"]
    (leaf / "Biology.json").write_text(json.dumps(rec))
    assert plan(grid, opts)[0].done == ("Biology",)
    write_result(out, "none", "none", "bm25", "Biology", RUN, config={"sampling": {"temperature": 0.0}})
    assert plan(grid, opts)[0].stale == {"Biology": "sampling {'temperature': 0.0}, the entry {}"}
    # Agentic: an unset loop retriever is the final one, so these two records are the same run.
    agentic = _grid(tmp_path, "{method: search-r1, llm: qwen-3b-ins, retriever: bge, "
                              "args: {loop_retriever: bge, prompts_from: own}}")
    fresh = ReproduceOptions(output_dir=out, tasks=("Biology",), generations="fresh")
    write_result(out, "search-r1", "qwen-3b-ins", "bge", "Biology", RUN, config={"loop_retriever": None})
    assert plan(agentic, fresh)[0].done == ("Biology",)
    # The same row with the authors' prompts (a grid's default) is another run: this one is stale.
    authors = _grid(tmp_path, "{method: search-r1, llm: qwen-3b-ins, retriever: bge, args: {loop_retriever: bge}}")
    assert plan(authors, fresh)[0].stale == {
        "Biology": "prompts_from 'own', the entry 'PeterGriffinJin/Search-R1@a14dc3a4ffc6'"}
    write_result(out, "search-r1", "qwen-3b-ins", "bge", "Biology", RUN, config={"loop_retriever": "bm25"})
    assert plan(agentic, fresh)[0].stale == {"Biology": "loop_retriever 'bm25', the entry 'bge'"}
    # A result file without a recorded config is never taken as done.
    leaf = out / "none" / "none" / "bm25"
    rec = json.loads((leaf / "Biology.json").read_text())
    del rec["config"]
    (leaf / "Biology.json").write_text(json.dumps(rec))
    assert plan(grid, opts)[0].stale == {"Biology": "no run config recorded"}
    # Nor is one that cannot be read; the reason names the file and line.
    (leaf / "Biology.json").write_bytes(b'{"test": {}, "note": "caf\xe9"}')
    reason = plan(grid, opts)[0].stale["Biology"]
    assert reason.startswith("unreadable result file (") and "Biology.json:1: not UTF-8 text" in reason


def test_released_and_fresh_results_never_stand_for_each_other(tmp_path):
    out = tmp_path / "results"
    grid = _grid(tmp_path, "{method: lamer, llm: qwen-7b, retriever: bm25, "
                           "args: {first_pass: bm25-compat, prompts_from: own}}")
    released = ReproduceOptions(output_dir=out, tasks=("Biology",))
    fresh = ReproduceOptions(output_dir=out, tasks=("Biology",), generations="fresh")
    assert plan(grid, released)[0].result_dir == out / "lamer" / "qwen-7b@r2med" / "bm25"
    # Released generations: LameR's first pass and sampling played no part in them.
    write_result(out, "lamer", "qwen-7b@r2med", "bm25", "Biology", RUN,
                 config={"llm": "qwen-7b", "generations": "r2med", "sampling": {"seed": 1}})
    assert plan(grid, released)[0].done == ("Biology",)
    # A file in that folder whose record says it generated is stale there.
    write_result(out, "lamer", "qwen-7b@r2med", "bm25", "Biology", RUN,
                 config={"llm": "qwen-7b", "first_pass": "bm25-compat"})
    assert plan(grid, released)[0].stale == {"Biology": "generations 'fresh', the entry 'r2med'"}
    # Fresh LameR: a record from before first_pass was recorded ran the Lucene-mode BM25.
    write_result(out, "lamer", "qwen-7b", "bm25", "Biology", RUN)
    rec_path = out / "lamer" / "qwen-7b" / "bm25" / "Biology.json"
    rec = json.loads(rec_path.read_text())
    for key in ("first_pass", "generations", "rerank_cut"):
        del rec["config"][key]
    rec_path.write_text(json.dumps(rec))
    assert plan(grid, fresh)[0].stale == {"Biology": "first_pass 'bm25', the entry 'bm25-compat'"}
    write_result(out, "lamer", "qwen-7b", "bm25", "Biology", RUN, config={"first_pass": "bm25-compat"})
    assert plan(grid, fresh)[0].done == ("Biology",)


def test_results_from_other_data_are_stale(tmp_path):
    from r2med_agent.data import get_task_spec, load_task

    out = tmp_path / "results"
    grid = _grid(tmp_path, "{method: none, retriever: bm25}")
    hub = ReproduceOptions(output_dir=out, tasks=("Biology",))
    # Hub data: the pinned repo@revision names the content.
    write_result(out, "none", "none", "bm25", "Biology", RUN, source="/elsewhere/Biology")
    provenance = get_task_spec("Biology").provenance
    assert plan(grid, hub)[0].stale == {
        "Biology": f"data from /elsewhere/Biology, the entry loads {provenance}"
    }
    # A task that follows a branch (NanoR2MED) records the commit it loaded: still its data.
    nano = ReproduceOptions(output_dir=out, tasks=("nano-Biology",))
    nano_source = get_task_spec("nano-Biology").provenance
    assert nano_source == "hf://datasets/hakari-bench/NanoR2MED@main#NanoR2MEDBiology"
    write_result(out, "none", "none", "bm25", "nano-Biology", RUN, source=f"{nano_source} (commit {'a' * 40})")
    assert plan(grid, nano)[0].done == ("nano-Biology",)
    write_result(out, "none", "none", "bm25", "nano-Biology", RUN, source=f"{nano_source}-other (commit {'a' * 40})")
    assert plan(grid, nano)[0].stale["nano-Biology"].startswith(f"data from {nano_source}-other")
    # A local copy: the corpus fingerprint of what the entry would load decides.
    data = tmp_path / "data"
    write_r2med_task(data / "Biology")
    local = ReproduceOptions(output_dir=out, tasks=("Biology",), data_dir=data, allow_count_mismatch=True)
    task = load_task("Biology", data, allow_count_mismatch=True)
    write_result(out, "none", "none", "bm25", "Biology", RUN, source=task.source, fingerprint=task.fingerprint)
    assert plan(grid, local)[0].done == ("Biology",)
    # The printed command runs what the plan checked: the same copy, with the same permission.
    assert plan(grid, local)[0].command.endswith(f"--data-dir {data} --allow-count-mismatch")
    assert "--allow-count-mismatch" not in plan(grid, hub)[0].command
    with (data / "Biology" / "corpus.jsonl").open("a") as f:
        f.write(json.dumps({"id": "d99", "text": "a new document"}) + "\n")
    reason = plan(grid, local)[0].stale["Biology"]
    assert reason.startswith(f"corpus changed (fingerprint {task.fingerprint[:12]}, now ")


def test_grid_files_are_validated(tmp_path):
    def grid(name: str, body: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text("title: t\nentries:\n" + body)
        return path

    with pytest.raises(ConfigError, match=r"unknown key\(s\) rerank; allowed: args, candidates, candidates_dir, candidates_from, differences, generations, llm, method"):
        load_grid(grid("key", "  - {method: none, retriever: bm25, rerank: x}\n"))
    with pytest.raises(ConfigError, match="method hyde needs an llm"):
        load_grid(grid("llm", "  - {method: hyde, retriever: bm25}\n"))
    with pytest.raises(ConfigError, match="unknown args rerank_n; allowed: sampling, samples, prompts_from, first_pass, fusion, rrf_k, fusion_weights, bm25_k1, bm25_b, loop_retriever, final, precision, encoder_backend, top_k, rerank_k, rerank_cut"):
        load_grid(grid("args", "  - {method: none, retriever: nv, reranker: monobert, args: {rerank_n: 10}}\n"))
    with pytest.raises(ConfigError, match="generations must be auto, fresh or bright, got 'r2med'"):
        load_grid(grid("gen", "  - {method: hyde, llm: qwen-7b, retriever: bm25, generations: r2med}\n"))
    assert load_grid(grid("genf", "  - {method: hyde, llm: qwen-7b, retriever: bm25, generations: fresh}\n")).entries[0].generations_mode() == "fresh"
    with pytest.raises(ConfigError, match=r"duplicate of entries\[0\]"):
        load_grid(grid("dup", "  - {method: none, retriever: bm25}\n  - {method: none, retriever: bm25}\n"))
    custom = grid("custom", "  - {method: none, retriever: minilm}\n")
    assert load_grid(custom).published == ({},)  # a custom grid may run unpublished configurations
    with pytest.raises(ConfigError, match="no row for"):
        load_grid(custom, strict=True)
    with pytest.raises(ConfigError, match="unknown table 'tables'"):
        load_grid("tables")
    with pytest.raises(ConfigError, match="grid file does not exist"):
        load_grid(tmp_path / "none.yaml")


def test_published_override_matches_renamed_runs(tmp_path):
    grid_file = tmp_path / "renamed.yaml"
    grid_file.write_text(
        "title: renamed\nentries:\n"
        "  - {method: none, retriever: medcpt-article, published: {retriever: medcpt}}\n"
    )
    grid = load_grid(grid_file)
    assert grid.entries[0].published_key == PublishedKey("none", "", "medcpt", "")
    # A grid of one's own may leave the scores out: the CSV's row of the published name is used.
    assert grid.published[0] == csv_ndcg()[("none", "", "medcpt", "")]
    out = tmp_path / "results"
    write_result(out, "none", "none", "medcpt-article", "Biology", RUN, QRELS)
    table = rep.results_table(grid, ReproduceOptions(output_dir=out, tasks=("Biology",)))
    assert table.rows[0].published == {"Biology": grid.published[0]["Biology"]}


def test_strict_grids_need_the_published_scores_beside_each_command(tmp_path):
    scores = csv_ndcg()[("none", "", "medcpt", "")]
    body = ", ".join(f"{t}: {scores[t]}" for t in r2med_tasks())
    path = tmp_path / "g.yaml"

    def write(ndcg: str) -> Path:
        path.write_text(f"title: t\nentries:\n  - {{method: none, retriever: medcpt{ndcg}}}\n")
        return path

    assert load_grid(write(f", ndcg_at_10: {{{body}}}"), strict=True).published[0] == scores
    with pytest.raises(ConfigError, match="ndcg_at_10 must give the published score of each of the 8 tasks"):
        load_grid(write(""), strict=True)
    with pytest.raises(ConfigError, match="wrong or missing: IIYi-Clinical"):
        load_grid(write(f", ndcg_at_10: {{{body.rsplit(', ', 1)[0]}}}"), strict=True)
    wrong = body.replace(f"Biology: {scores['Biology']}", "Biology: 0.5")
    with pytest.raises(ConfigError, match=rf"differs from published_results.csv on Biology \(0.5 vs {scores['Biology']}\)"):
        load_grid(write(f", ndcg_at_10: {{{wrong}}}"), strict=True)
    with pytest.raises(ConfigError, match="ndcg_at_10.Biology must be a number"):
        load_grid(write(", ndcg_at_10: {Biology: high}"))


def test_dry_run_prints_the_scores_per_task(cli, tmp_path):
    res = CliRunner().invoke(cli, ["reproduce", "--table", "retrievers", "--dry-run", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    bm25 = csv_ndcg()[("none", "", "bm25", "")]
    line = "    paper nDCG@10: " + ", ".join(f"{t} {bm25[t]}" for t in r2med_tasks()) + "\n"
    assert line in res.output
    res = CliRunner().invoke(
        cli, ["reproduce", "--table", "retrievers", "--dry-run", "-o", str(tmp_path / "o"), "--tasks", "Biology,MedQA-Diag"]
    )
    assert f"    paper nDCG@10: Biology {bm25['Biology']}, MedQA-Diag {bm25['MedQA-Diag']}\n" in res.output


def test_cli_needs_exactly_one_grid(cli):
    res = CliRunner().invoke(cli, ["reproduce", "--dry-run"])
    assert isinstance(res.exception, ConfigError) and "exactly one of --table" in str(res.exception)


def test_reproduce_runs_a_grid_through_the_real_runner(cli, tmp_path, monkeypatch):
    # BM25 on the embedded sample task: the runner, bm25s and pytrec_eval for real, offline.
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text("title: sample\nentries:\n  - {method: none, retriever: bm25}\n")
    out = tmp_path / "results"
    args = ["reproduce", "--grid", str(grid_file), "--tasks", "sample", "--output-dir", str(out), "--format", "csv"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    result = out / "none" / "none" / "bm25" / "sample.json"
    assert result.exists() and (out / "none" / "none" / "bm25" / "sample.run").exists()
    import json

    score = json.loads(result.read_text())["test"]["ndcg_at_10"]
    rec = next(csv.DictReader(res.stdout.splitlines()))
    assert float(rec["sample"]) == score
    assert rec["sample_published"] == ""  # the paper has no number for the sample task
    # A second call finds the files and runs nothing.
    mtime = result.stat().st_mtime_ns
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0 and result.stat().st_mtime_ns == mtime


def test_run_args_are_runner_fields_and_run_flags(cli):
    import dataclasses

    import typer

    from r2med_agent.api import RunConfig

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    run = typer.main.get_command(cli).commands["run"]
    flags = {opt for p in run.params for opt in p.opts}
    for arg in RUN_ARGS:
        assert arg in fields
        if arg == "sampling":  # a mapping: one flag per override
            assert set(SAMPLING_FLAGS.values()) <= flags
            continue
        if arg == "kind_options":  # a mapping: one flag per field a registered kind declares
            from r2med_agent.retrieval.registry import kind_option_fields

            assert {names[0] for _, _, names, _ in kind_option_fields()} <= flags
            continue
        assert SPEC_FLAGS.get(arg, f"--{arg.replace('_', '-')}") in flags


def test_reproduce_scores_released_generations_without_an_llm(cli, tmp_path, monkeypatch):
    # The demo's HyDE row: R2MED's released qwen-7b file ships with the packaged r2med-demo task.
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text("title: demo\nentries:\n  - {method: hyde, llm: qwen-7b, retriever: bm25}\n")
    out = tmp_path / "results"
    args = ["reproduce", "--grid", str(grid_file), "--tasks", "r2med-demo", "--output-dir", str(out)]
    dry = CliRunner().invoke(cli, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "--llm qwen-7b --generations r2med --retriever bm25" in dry.output
    assert "generations: released by R2MED (hyde/qwen-7b/query_with_hydoc.jsonl" in dry.output
    assert "GPU: none (CPU only)" in dry.output
    res = CliRunner().invoke(cli, [*args, "--format", "csv"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "hyde" / "qwen-7b@r2med" / "bm25" / "r2med-demo.json").read_text())
    assert record["generations"] == "r2med" and record["stats"]["generations"] == 0
    assert "hyde,qwen-7b@r2med,bm25" in res.stdout
    # --generations fresh plans the generating run in its own folder.
    fresh = CliRunner().invoke(cli, [*args, "--dry-run", "--generations", "fresh"])
    assert "--generations r2med" not in fresh.output and "(to run;" in fresh.output
    bad = CliRunner().invoke(cli, [*args, "--dry-run", "--generations", "hub"])
    assert bad.exit_code != 0


def test_beyond_grid_sets_each_entry_beside_the_best_published_average(tmp_path):
    from r2med_agent.api import ReproduceOptions, format_plan, plan

    pub = csv_ndcg()
    averages = {k: sum(v.values()) / len(v) for k, v in pub.items() if len(v) == 8}
    best = max(averages, key=averages.get)
    assert best == ("query2doc", "gpt4", "nv", "") and round(100 * averages[best], 2) == 41.65
    # The best published row since the paper: GroupRank-32B over DIVER-Retriever-4B (52.3).
    frontier = published_results()
    grouprank = PublishedKey("none", "", "diver-4b", "grouprank-32b")
    assert max(frontier.keys("frontier"), key=lambda k: frontier.average(k) or 0) == grouprank
    grid = load_grids()["beyond"]
    beside = []
    for entry, scores in zip(grid.entries, grid.published):
        key = entry.published_key
        beside.append(key)
        if key == grouprank:
            assert scores == frontier.scores(grouprank)
        else:
            assert (key.method, key.llm, key.retriever, key.reranker) == best and scores == pub[best]
        # None is published (the first differs from the published HyDE row by its 4 samples).
        assert (entry.method, entry.llm, entry.retriever, entry.reranker) not in pub or entry.args.get("samples", 1) > 1
        assert frontier.kinds.get(PublishedKey(entry.method, entry.llm, entry.retriever, entry.reranker)) != "frontier"
    assert beside.count(grouprank) == 4
    planned = plan(grid, ReproduceOptions(output_dir=tmp_path))
    text = format_plan(planned)
    assert "tokens: qwen3-32b-listwise (9 windows of 20 per query): 7,884 calls" in text  # 876 queries x 9
    assert "--samples 4" in text and "reranker LLM qwen3-32b" in text and "PROBLEM" not in text
    assert "--retriever bm25+reasonembed-qwen3-8b:query --reranker grouprank-32b --fusion-depth 1000,200" in text
    # Issue 30 item 1: R2MED released one text per query, so no row scores released texts as samples.
    for p in planned:
        if p.entry.args.get("samples", 1) > 1:
            assert p.generations == "fresh" and "--generations r2med" not in p.command, p.entry.label


def test_no_grid_scores_released_generations_as_several_samples(tmp_path):
    """Issue 30 item 1: an entry with several samples per query generates them, in every grid and
    whatever its ``generations`` says: R2MED's released files hold one text per query."""
    from r2med_agent.grids.grid import GridEntry

    entry = GridEntry(method="hyde", llm="qwen-7b", retriever="bm25", args={"samples": 4})
    assert entry.generations_mode("r2med") == "fresh"
    assert GridEntry(method="hyde", llm="qwen-7b", retriever="bm25").generations_mode("r2med") == "r2med"
    for table, grid in load_grids().items():
        for p in plan(grid, ReproduceOptions(output_dir=tmp_path)):
            if p.entry.args.get("samples", 1) > 1:
                assert p.generations == "fresh", (table, p.entry.label)


@pytest.mark.parametrize("generations", ["r2med", "fresh"])
def test_dry_run_advice_matches_how_each_row_runs(tmp_path, generations):
    """Item 8: a row scored from R2MED's released generations runs no LLM, so its advice never
    serves one under vLLM (nor names its weights, keys or tokens); a row that generates with a
    vLLM model beside an encoder that pins another transformers gets the split recipe."""
    from packaging.specifiers import SpecifierSet

    registries = Registries()
    planned = plan(load_grid("gar"), ReproduceOptions(output_dir=tmp_path, generations=generations))
    released = [p for p in planned if p.generations == "r2med"]
    assert generations == "fresh" or len(released) >= 12
    for p in planned:
        text = "\n".join(p.needs.lines())
        llm = registries.llm(p.entry.llm)
        if p.generations == "r2med":
            assert "no LLM runs" in text, p.entry.label
            for word in ("vllm", "vLLM", "SPLIT", "-served", llm.model, "LLM " + p.entry.llm, "tokens:"):
                assert word not in text, (p.entry.label, word)
            assert all(k != llm.api_key_env for k in p.needs.api_keys), p.entry.label
        else:
            encoders = [registries.encoder(part) for part in p.entry.retriever.split("+")]
            pinned = any(getattr(e, "transformers", "") and not SpecifierSet(e.transformers).contains("5.16.1")
                         for e in encoders)
            split = any(line.startswith("SPLIT ENVIRONMENTS") for line in p.needs.split)
            assert split == (pinned and llm.backend == "vllm"), p.entry.label
            if split:
                assert f"--model {llm.model}" in "\n".join(p.needs.split)


def test_dry_run_shows_each_rows_identical_id_and_empty_generation_policy(tmp_path):
    # The package grids run as R2MED's scripts did (their top-level args), each row keeping what
    # applies to it: BM25 excludes no ids, a row without an LLM has no generations.
    grids = load_grids()
    opts = ReproduceOptions(output_dir=tmp_path, generations="fresh")
    listings = {name: format_plan(plan(grids[name], opts)) for name in ("retrievers", "gar", "agentic", "rerank")}

    def block(table: str, label: str) -> str:
        text = listings[table]
        start = text.index(f"] {label}  (")
        return text[start:text.index("\n[", start)] if "\n[" in text[start:] else text[start:]

    assert "    identical ids excluded; no generations\n" in block("retrievers", "none/none/nv")
    assert "    identical ids kept; no generations\n" in block("retrievers", "none/none/bm25-compat")
    assert ("    identical ids excluded; empty generations kept; vLLM prompt rendered\n"
            in block("gar", "hyde/qwen-7b/nv"))
    assert "    identical ids kept; empty generations kept; vLLM prompt rendered\n" in block("gar", "hyde/qwen-7b/bm25-compat")
    assert "    identical ids excluded; empty generations kept\n" in block("gar", "hyde/gpt4/nv")  # an API model
    assert "    identical ids excluded; empty generations kept\n" in block("agentic", "search-o1/qwq-32b/nv")
    assert "    identical ids excluded; no generations\n" in block("rerank", "none/none/nv/rankllama")
    # A grid of one's own takes no policy unless it says so; an entry's own args win over the grid's.
    own = _grid(tmp_path, "{method: hyde, llm: qwen-7b, retriever: nv}")
    assert "    identical ids kept; empty generations -> the query\n" in format_plan(plan(own, opts))
    path = tmp_path / "with-args.yaml"
    path.write_text("title: t\nargs: {exclude_identical_ids: true, empty_generation: keep}\nentries:\n"
                    "  - {method: hyde, llm: qwen-7b, retriever: nv, args: {empty_generation: query}}\n")
    assert load_grid(path).entries[0].args == {"exclude_identical_ids": True, "empty_generation": "query"}
    path.write_text("title: t\nargs: {exclude_ids: true}\nentries:\n  - {method: none, retriever: nv}\n")
    with pytest.raises(ConfigError, match="unknown args exclude_ids"):
        load_grid(path)


@pytest.mark.parametrize("generations", ["r2med", "fresh"])
def test_dry_runs_add_up_their_llm_work_and_never_print_zero_hours(tmp_path, generations):
    """Issue 30 item 9: every grid's dry run ends with the grand total of the LLM work still to
    run (calls, tokens, GPU-hours, dollars: the rows' estimates added up); no row reads "≤0
    GPU-hours"; a fresh agentic row has its estimate; an API reranker (InsertRank over DeepSeek)
    its cost; rows over given run files name the folder they come in."""
    from r2med_agent.grids.estimates import format_hours

    for table, grid in load_grids().items():
        planned = plan(grid, ReproduceOptions(output_dir=tmp_path, generations=generations))
        text = format_plan(planned)
        assert "≤0 GPU-hours" not in text and "<run files>" not in text, table
        estimates = [e for p in planned if p.pending for e in p.needs.estimates]
        encoding = [e for p in planned if p.pending for e in p.needs.encoding]  # issue 39 item 17
        if not estimates and not encoding:
            assert "total of the" not in text, table
            continue
        total = next(line for line in text.splitlines() if line.startswith("total of the"))
        if estimates:
            assert f"{sum(e.calls for e in estimates):,} LLM calls" in total, table
            assert f"≤{sum(e.output_tokens for e in estimates) / 1e6:,.1f}M output tokens" in total, table
        corpora = {e.doc_key: e for e in encoding}.values()  # a corpus is embedded once per encoder
        hours = [e.gpu_hours for e in estimates if e.gpu_hours is not None] + \
            [e.doc_hours for e in corpora if e.doc_hours is not None] + \
            [e.query_hours for e in encoding if e.query_hours is not None]
        if hours:
            assert f"{format_hours(sum(hours))} GPU-hours" in total, table
        for p in planned:
            if p.generations == "fresh" and p.entry.llm and p.pending:
                assert any(line.startswith(f"{p.entry.method} {p.entry.llm}") for line in p.needs.tokens), p.entry.label
    assert format_hours(0.23) == "0.2" and format_hours(0.01) == "<0.1" and format_hours(12.4) == "12"


def test_dry_run_estimates_of_a_loop_an_api_reranker_and_given_run_files(tmp_path):
    registries = Registries()
    agentic = plan(load_grid("agentic"), ReproduceOptions(output_dir=tmp_path, generations="fresh"))
    r1 = next(p for p in agentic if p.entry.method == "search-r1" and p.entry.llm == "qwen-7b-ins")
    [line] = r1.needs.tokens
    # Search-R1 at its limits: 4 searching turns and a final one of 500 tokens each, each turn's
    # prompt the task prompt (~400) plus every earlier turn's output and its 500-token observation.
    per_query = sum(400 + t * (500 + 500) for t in range(5))
    assert f"(≤5 steps per query): {5 * 876:,} calls, ≤{per_query * 876 / 1e6:.1f}M prompt tokens, " \
           f"≤{5 * 500 * 876 / 1e6:.1f}M output tokens" in line
    o1 = next(p for p in agentic if p.entry.method == "search-o1")
    assert "Reason-in-Documents calls per query" in o1.needs.tokens[0]
    frontier = format_plan(plan(load_grid("frontier"), ReproduceOptions(output_dir=tmp_path)))
    insert = next(x for x in frontier.splitlines() if "tokens: insertrank-r1" in x)
    deepseek = registries.llm("deepseek-r1")
    assert deepseek.price_in_per_mtok > 0 and ", ≤$" in insert and "cost unknown" not in insert
    assert "--candidates ReasonRank/runs --reranker reasonrank-32b" in frontier
    assert "git clone https://github.com/8421BCD/ReasonRank, then --candidates ReasonRank/runs" in frontier
