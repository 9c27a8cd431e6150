"""The grid's schedule on a cluster (r2med_agent.grids): generation stages, each row's resource
request, the packing onto GPUs, a row's trip to a worker and back; no Ray needed."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from r2med_agent.experiment.resolve import Registries
from r2med_agent.experiment.resolve import resolve as plan_of
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.grids.cluster import build_jobs, row_hours, schedule_lines, write_output
from r2med_agent.grids.rows import RowJob, RowOptions, RowOutput, resolve_row
from r2med_agent.grids.schedule import embedding_stage, idle_share, longest_chain, pack, row_resources, stage_key
from r2med_agent.llm.cache.records import CacheRecord, Use
from r2med_agent.api import ReproduceOptions, load_grid, plan


def test_rows_with_equal_generating_settings_share_one_stage():
    hyde = RunSpec(method="hyde", llm="qwen-7b", retriever="bm25")
    assert stage_key(hyde) == stage_key(RunSpec(method="hyde", llm="qwen-7b", retriever="medcpt", top_k=50))
    assert stage_key(hyde) != stage_key(RunSpec(method="hyde", llm="qwen-7b", retriever="bm25",
                                                sampling={"temperature": 0.3}))
    assert stage_key(RunSpec(method="hyde", llm="qwen-7b", generations="r2med")) is None  # released texts
    assert stage_key(RunSpec(method="none")) is None
    # A loop searches between turns: its retriever is part of what it sends.
    r1 = RunSpec(method="search-r1", llm="qwen-7b", retriever="bm25")
    assert stage_key(r1, agentic=True) != stage_key(RunSpec(method="search-r1", llm="qwen-7b", retriever="medcpt"),
                                                    agentic=True)


def test_each_row_asks_for_the_gpus_of_its_models():
    assert row_resources(plan_of(RunSpec(method="none", retriever="bm25"))).num_gpus == 0
    assert row_resources(plan_of(RunSpec(method="none", retriever="medcpt"))).num_gpus == 1
    tp = Registries().llm("qwen-32b").tensor_parallel_size
    assert tp > 1 and row_resources(plan_of(RunSpec(method="hyde", llm="qwen-32b", retriever="bm25"))).num_gpus == tp
    # Released generations: the LLM never runs.
    assert row_resources(plan_of(RunSpec(method="hyde", llm="qwen-32b", generations="r2med"))).num_gpus == 0


def test_pack_places_rows_on_free_gpus_after_their_stage():
    # Row 1 reads row 0's stage; row 2 needs 2 GPUs; 2 GPUs in all.
    slots = {s.index: s for s in pack([2.0, 1.0, 3.0, 1.0], [1, 1, 2, 0], {1: [0]}, 2)}
    assert slots[2].start == 0.0 and slots[2].end == 3.0  # the longest ready row first
    assert slots[0].start == 3.0 and slots[1].start == slots[0].end == 5.0
    assert slots[3].start == 0.0  # a CPU row runs beside the others
    assert longest_chain([2.0, 1.0, 3.0, 1.0], {1: [0]}) == 3.0
    assert round(idle_share(list(slots.values()), 2), 4) == round(1 - (2 + 1 + 6) / (6 * 2), 4)
    assert 5 not in {s.index for s in pack([1.0], [4], {}, 2)}  # too big: left out


def test_dependent_rows_wait_for_the_row_that_makes_their_stage(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("title: t\nentries:\n  - {method: hyde, llm: qwen-7b, retriever: bm25}\n"
                    "  - {method: hyde, llm: qwen-7b, retriever: medcpt}\n  - {method: none, retriever: bm25}\n")
    opts = ReproduceOptions(output_dir=Path("results"), tasks=("sample",), generations="fresh")
    jobs = build_jobs(plan(load_grid(grid), opts), opts)
    assert [j.after for j in jobs] == [(), (0,), ()]
    assert jobs[0].stages[0] == jobs[1].stages[0] == jobs[1].reads[0] and jobs[2].stages == ()
    assert [j.resources.num_gpus for j in jobs] == [jobs[0].resources.num_gpus, 1, 0]


def test_a_row_waits_for_every_row_that_makes_a_stage_it_reads():
    # Row 2 reads row 0's embeddings and row 1's generations: it starts after both.
    slots = {s.index: s for s in pack([2.0, 1.0, 1.0], [1, 1, 1], {2: [0, 1]}, 2)}
    assert slots[2].start == 2.0
    assert longest_chain([2.0, 1.0, 1.0], {2: [0, 1]}) == 3.0


def test_rows_of_one_encoder_share_its_corpus_embeddings(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("title: t\nentries:\n  - {method: none, retriever: medcpt}\n"
                    "  - {method: none, retriever: bm25+medcpt}\n  - {method: none, retriever: bm25}\n"
                    "  - {method: hyde, llm: qwen-7b, retriever: medcpt}\n")
    opts = ReproduceOptions(output_dir=Path("results"), tasks=("sample",), generations="fresh")
    planned = plan(load_grid(grid), opts)
    jobs = build_jobs(planned, opts)
    assert jobs[0].stages == (embedding_stage("medcpt", "sample"),) and jobs[0].reads == ()
    assert [j.after for j in jobs] == [(), (0,), (), (0,)]
    assert jobs[1].reads == jobs[0].stages and jobs[2].stages == ()
    assert jobs[3].reads == jobs[0].stages and len(jobs[3].stages) == 2  # its generation stage, made by itself
    # The encoding of the corpus counts once: in the row that makes it.
    made, reads = row_hours(planned[0], 1, jobs[0].reads), row_hours(planned[1], 1, jobs[1].reads)
    assert made > 0 and reads < made and reads == pytest.approx(row_hours(planned[1], 1, ()) - planned[1].needs.encoding[0].doc_hours)
    text = "\n".join(schedule_lines(planned, jobs, 2, 80))
    assert "[0] none/none/medcpt: 1 GPU(s), 1 CPU(s); " in text and "makes 1 embedding stage(s)" in text
    assert "[1] none/none/bm25+medcpt" in text and "reads the stage of [0]" in text
    assert "1 corpus embedding(s) made once" in text



def test_a_word_searched_with_the_original_query_reads_its_encoders_stage(tmp_path):
    # ``medcpt:query`` searches with the encoder ``medcpt`` (the suffix only says which query it
    # embeds): the row reads the corpus embeddings row 0 makes, asks for a GPU, and runs after it.
    grid = tmp_path / "g.yaml"
    grid.write_text("title: t\nentries:\n  - {method: none, retriever: medcpt}\n"
                    "  - {method: hyde, llm: qwen-7b, retriever: 'bm25+medcpt:query'}\n")
    opts = ReproduceOptions(output_dir=Path("results"), tasks=("sample",), generations="fresh")
    planned = plan(load_grid(grid), opts)
    assert [name for name, _ in planned[1].plan.encoders] == ["medcpt"]
    jobs = build_jobs(planned, opts)
    assert embedding_stage("medcpt", "sample") in jobs[1].reads and jobs[1].after == (0,)
    assert row_resources(planned[1].plan).num_gpus >= 1

def test_a_row_ships_as_its_spec_and_resolves_to_it_in_another_process():
    spec = RunSpec(method="none", retriever="bm25-compat", top_k=50)
    job = RowJob(0, "none/none/bm25-compat", spec.key(), ("sample",), RowOptions())
    cfg = resolve_row(pickle.loads(pickle.dumps(job)))
    assert cfg.spec().key() == spec.key() and cfg.tasks == ("sample",) and cfg.output_dir == Path("results")


def test_the_driver_writes_caches_then_result_files(tmp_path, monkeypatch):
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    rec = CacheRecord(key="k1", model_id="m", sample_index=0, text="t", reasoning="", final="t",
                      finish_reason="stop", stop_reason=None, prompt_tokens=1, completion_tokens=1, latency_s=0.1,
                      created=1.0, request={"messages": []})
    out = RowOutput(0, {"a/b/x.run": b"run\n", "a/b/x.json": b"{}\n"}, [rec], [Use("k1", "sample", "q1", "hyde")],
                    {"enc__abc/meta.json": b"{}"}, "node", 1.0)
    write_output(out, tmp_path / "results")
    assert (tmp_path / "results" / "a" / "b" / "x.json").read_bytes() == b"{}\n"
    assert (tmp_path / "cache" / "embeddings" / "enc__abc" / "meta.json").exists()
    from r2med_agent.llm.cache.store import GenerationCache

    with GenerationCache(tmp_path / "cache" / "generations.sqlite") as cache:
        assert cache.get("k1") is not None and cache.uses()[0][0].query_id == "q1"


def test_dry_run_with_gpus_prints_the_frontier_schedule(tmp_path):
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    res = CliRunner().invoke(app, ["reproduce", "--table", "frontier", "--dry-run", "--ray", "auto", "--gpus", "8",
                                   "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "schedule on 8 GPU(s) of 80 GiB (25 row(s) to run):" in res.output
    assert "none/none/diver-4b/grouprank-32b: 2 GPU(s), 1 CPU(s);" in res.output
    line = next(x for x in res.output.splitlines() if x.startswith("estimated makespan"))
    assert "on 8 GPU(s) (idle GPU share" in line and "sequential total" in line
