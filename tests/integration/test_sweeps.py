"""Parameter sweeps on the embedded sample through the real CLI: every run keeps its own folder,
and `compare` shows each as its own row, labelled by what differs. Real llama.cpp (SmolLM2), real
MiniLM, real BM25, real pytrec_eval. The runs read the sample cut to its first two queries (the
whole corpus): the checks are about identity and labels, and each LLM run costs a sixth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.api import build_table, load_results
from r2med_agent.experiment.spec import RunSpec
from tests.sample_subset import sample_subset

pytestmark = pytest.mark.slow


def _run(out: Path, *args: str) -> None:
    data = out.parent / "data"
    if not data.exists():
        sample_subset(data)
    assert main(["run", "--task", "sample", "--data-dir", str(data), "--allow-count-mismatch", "-o", str(out),
                 "--no-progress", *args]) == 0


def _rows_by_label(out: Path) -> dict[str, float]:
    table = build_table(load_results([out]), "ndcg_at_10")
    labels = [r.row.label for r in table.rows]
    assert len(labels) == len(set(labels)), labels  # no two rows look the same
    return {r.row.label: r.values["sample"] for r in table.rows}


def test_sampling_sweeps_keep_every_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    temperatures = ["0", "0.3", "0.6", "0.9", "1.2"]
    for t in temperatures:
        _run(out, "--method", "hyde", "--llm", "smollm2", "--max-tokens", "12", "--temperature", t)
    max_tokens = ["4", "8", "16", "24", "32"]
    for m in max_tokens:
        _run(out, "--method", "hyde", "--llm", "smollm2", "--max-tokens", m, "--temperature", "0")
    folders = {p.parent for p in out.rglob("sample.json")}
    assert len(folders) == 10
    rows = _rows_by_label(out)
    for t in temperatures:
        assert f"hyde/smollm2/bm25 [sampling.max_tokens=12, sampling.temperature={float(t):g}]" in rows
    for m in max_tokens:
        assert f"hyde/smollm2/bm25 [sampling.max_tokens={m}, sampling.temperature=0]" in rows
    # Each folder's spec.json names its own settings; the result files record the same spec.
    for folder in folders:
        spec = json.loads((folder / "spec.json").read_text())
        record = json.loads((folder / "sample.json").read_text())
        assert RunSpec.from_record(record["config"]).key() == spec["key"]
        assert folder.name.endswith(spec["digest"])


def test_model_setting_sweeps_keep_every_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    depths = ["2", "3", "4", "5", "6"]
    for k in depths:
        _run(out, "--reranker", "smollm2-listwise", "--rerank-k", k)
    precisions = ["float32", "float16", "bfloat16", "autocast-float16", "auto"]
    for p in precisions:
        _run(out, "--retriever", "minilm", "--precision", p)
    # The encoder backend has three values (and the entry's own, the default); without vLLM and
    # a GPU, auto and the default both resolve to transformers, but each is its own run spec.
    backends = ["auto", "transformers"]
    _run(out, "--retriever", "minilm")
    for b in backends:
        _run(out, "--retriever", "minilm", "--encoder-backend", b)
    # precision with a reranker: read back as a precision, never as a reranker named bfloat16
    _run(out, "--retriever", "minilm", "--precision", "bfloat16", "--reranker", "smollm2-listwise", "--rerank-k", "3")
    rows = _rows_by_label(out)
    for k in depths:
        assert f"none/none/bm25/smollm2-listwise [rerank_k={k}]" in rows
    for p in precisions:
        assert f"none/none/minilm [precision={p}]" in rows
    for b in backends:
        assert f"none/none/minilm [encoder_backend={b}]" in rows
    assert "none/none/minilm" in rows
    assert "none/none/minilm/smollm2-listwise [precision=bfloat16, rerank_k=3]" in rows
    assert len(rows) == len(depths) + len(precisions) + 1 + len(backends) + 1
    # On a CPU every precision runs in float32: the same scores, in five rows that say so.
    assert len({rows[f"none/none/minilm [precision={p}]"] for p in precisions}) == 1
