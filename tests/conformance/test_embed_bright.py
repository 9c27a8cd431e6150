"""The reasoning embedders' BRIGHT settings (each entry's ``bright:`` block) against the authors'
BRIGHT code where the pinned copies hold it.

- ReasonEmbed's BRIGHT scripts (VectorSpaceLab/agentic-search ``ReasonEmbed/evaluation_bright/
  scripts/``), run by bash itself with a stand-in ``python`` on ``PATH`` that keeps the arguments
  ``eval $cmd`` gives it; those arguments parsed by FlagEmbedding's own argument classes (pinned
  FlagOpen/FlagEmbedding); the embedder built from them (FlagEmbedding's ``BaseLLMEmbedder``) with
  each task's instruction set as FlagEmbedding's ``BrightEvalRunner.run`` sets it, on a tiny random
  model: the strings, the token limit, the token ids and the vectors.
- ReasonIR's ``retrieval_reasonir`` as DIVER's repository carries it (AQ-MedAI/Diver
  ``Retriever/retrievers.py``: ReasonIR's ``evaluation/bright/retrievers.py`` function with another
  checkpoint path and its query-embedding cache commented out), with ReasonIR's model replaced by a
  recorder of what ``ReasonIRModel.encode`` is given (``test_embed_reasonir.py`` runs ``encode``).

The instruction strings themselves (FlagEmbedding's ``evaluation/bright/prompts.py``, ReasonIR's
``evaluation/bright/configs/reasonir/``) are recorded in ``tests/bright_embedder_sources.py``, which
the unit tests check against the project's entries without the copies; here those recorded values
are checked against the authors' files in the pinned copies, and the ReasonIR cases read the
configurations from the copy itself. RaDeR's BRIGHT code has no pinned copy:
``tests/unit/retrieval/test_bright_encoder_settings.py`` checks it against its recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.instructions import settings_for_task
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.bright_embedder_sources import (
    FLAG_BRIGHT_LONG,
    FLAG_BRIGHT_SHORT,
    KEYS,
    LONG_KEYS,
    REASONIR_DOC,
    REASONIR_QUERY,
    task_name,
)
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.embedder_inputs import HOSTILE_TEXTS, project_token_ids, task_prefixes, tokenizer_corpus
from tests.conformance.reasonembed_code import AGENTIC, FLAG, Code, RecordingTokenizer
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model

SCRIPTS = "ReasonEmbed/evaluation_bright/scripts"
# script (under ReasonEmbed/evaluation_bright/) -> (the project's entry, its architecture class)
FOLLOWED = {
    "scripts/ours/eval_reason_embed_qwen3_8b.sh": ("reasonembed-qwen3-8b", "qwen3"),
    "scripts/ours/eval_reason_embed_qwen3_4b.sh": ("reasonembed-qwen3-4b", "qwen3"),
    "scripts/ours/eval_reason_embed_llama_3.1_8b.sh": ("reasonembed-llama-8b", "llama"),
    "scripts/baselines/eval_qwen3_embedding_8b.sh": ("qwen3-embedding-8b", "qwen3"),
    "scripts/baselines/eval_qwen3_embedding_4b.sh": ("qwen3-embedding-4b", "qwen3"),
}
# The unreleased "basic" models: no entry.
NOT_FOLLOWED = {"scripts/ours/eval_reason_embed_basic_qwen3_8b.sh", "scripts/ours/eval_reason_embed_basic_qwen3_4b.sh",
                "scripts/ours/eval_reason_embed_basic_llama_3.1_8b.sh"}
ONE_PER_CLASS = ["scripts/ours/eval_reason_embed_qwen3_8b.sh", "scripts/ours/eval_reason_embed_llama_3.1_8b.sh"]


@pytest.fixture(scope="module")
def code() -> Code:
    return Code()


def _scripts(agentic: Path) -> dict[str, Path]:
    root = agentic / "ReasonEmbed" / "evaluation_bright"
    return {str(p.relative_to(root)): p for p in sorted((agentic / SCRIPTS).rglob("eval_*.sh"))}


def script_argv(script: Path, tmp_path: Path) -> list[list[str]]:
    """What ``bash script`` hands ``python`` (one list per call), with a stand-in ``python`` first
    on ``PATH`` that writes its arguments down: the script's own variables, quoting and
    ``eval $cmd``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['ARGV_LOG'], 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    log = tmp_path / "argv.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ARGV_LOG": str(log)}
    subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)
    return [json.loads(line) for line in log.read_text().splitlines()]


def parse(code: Code, argv: list[str]) -> tuple[Any, Any, list[str]]:
    """``python -m FlagEmbedding.evaluation.bright`` parses ``(BrightEvalArgs, BrightEvalModelArgs)``:
    AbsEvalArgs plus ``task_type`` and ``use_special_instructions`` (evaluation/bright/arguments.py,
    not pinned: they come back as the remaining arguments), and AbsEvalModelArgs."""
    from transformers import HfArgumentParser

    assert argv[:2] == ["-m", "FlagEmbedding.evaluation.bright"], argv[:2]
    parser = HfArgumentParser((code.flag_args.AbsEvalArgs, code.flag_args.AbsEvalModelArgs))
    eval_args, model_args, rest = parser.parse_args_into_dataclasses(args=argv[2:], return_remaining_strings=True)
    return eval_args, model_args, rest


def test_every_bright_script_is_followed_or_named(code: Code) -> None:
    assert set(_scripts(code.agentic)) == set(FOLLOWED) | NOT_FOLLOWED


@pytest.mark.parametrize("script", sorted(FOLLOWED))
def test_the_entries_bright_settings_are_the_scripts(code: Code, script: str, tmp_path: Path) -> None:
    name, _ = FOLLOWED[script]
    (argv,) = script_argv(_scripts(code.agentic)[script], tmp_path)  # one split: examples
    eval_args, model_args, rest = parse(code, argv)
    assert rest == ["--task_type", "short", "--use_special_instructions", "True"]  # BrightShortInstructions per task
    assert eval_args.dataset_names == list(KEYS) and eval_args.splits == ["examples"]
    assert eval_args.search_top_k >= 1000 and model_args.embedder_model_class == "decoder-only-base"
    spec = get_encoder_spec(name)
    fmt = model_args.query_instruction_format_for_retrieval
    detailed = code.decoder_only.BaseLLMEmbedder.get_detailed_instruct
    for key in KEYS:
        task = task_name(key)
        on = settings_for_task(spec, task)
        assert on.model == model_args.embedder_name_or_path
        assert on.max_length == model_args.embedder_query_max_length == model_args.embedder_passage_max_length == 8192
        assert on.query_max_length in (None, on.max_length) and on.batch_size == model_args.embedder_batch_size
        assert (model_args.pooling_method, on.pooling) == ("last_token", "last-token")
        assert on.normalize == model_args.normalize_embeddings is True
        assert model_args.use_fp16 and on.precision == "float16" and on.trust_remote_code == model_args.trust_remote_code
        prefixes = task_prefixes(on, task)
        for q in ("Why do moths fly to light?", *HOSTILE_TEXTS):
            assert prefixes.query + q == detailed(fmt, FLAG_BRIGHT_SHORT[key], q), task
        assert prefixes.doc == "" and model_args.query_instruction_for_retrieval is None
    assert on.reference.startswith(f"{AGENTIC}@{code.agentic.name.rsplit('@', 1)[1]} ReasonEmbed/evaluation_bright/{script}")


@pytest.mark.parametrize("script", ONE_PER_CLASS)
def test_the_authors_embedder_on_a_bright_task_tokenizes_and_embeds_as_the_entry(
        code: Code, script: str, tmp_path: Path) -> None:
    name, arch = FOLLOWED[script]
    (argv,) = script_argv(_scripts(code.agentic)[script], tmp_path)
    _, model_args, _ = parse(code, argv)
    folder = tmp_path / f"tiny-{arch}"
    tiny_model(arch, folder, byte_bpe_tokenizer(tokenizer_corpus(), **TOKENIZER_STYLES[arch]), positions=1024)
    # float32 on a CPU either way; one device for the script's eight GPUs (each encodes its share
    # with the same encode_single_device).
    embedder = code.embedder(model_args, folder, use_fp16=False, devices=["cpu"])
    assert embedder.target_devices == ["cpu"]
    recorder = embedder.tokenizer = RecordingTokenizer(embedder.tokenizer)
    key = "sustainable_living"
    embedder.query_instruction_for_retrieval = FLAG_BRIGHT_SHORT[key]  # as BrightEvalRunner.run sets it
    on = dataclasses.replace(settings_for_task(get_encoder_spec(name), task_name(key)), model=str(folder))
    prefixes = task_prefixes(on, task_name(key))
    ours = HFEncoder(on, device="cpu")
    texts = ["Is composting better than landfill for food waste?", *[t for t in HOSTILE_TEXTS if t.strip()]]
    for side, prefix, theirs in (("query", prefixes.query, embedder.encode_queries), ("doc", prefixes.doc, embedder.encode_corpus)):
        recorder.texts.clear()
        recorder.ids.clear()
        recorder.max_lengths.clear()
        got = theirs(texts)
        strings = [prefix + t for t in texts]
        assert recorder.texts[:len(strings)] == strings, side
        assert recorder.max_lengths == {8192}  # the scripts' --embedder_*_max_length
        assert recorder.ids[:len(strings)] == project_token_ids(on, folder, strings, side), side
        np.testing.assert_allclose(ours.encode(texts, side=side, prefix=prefix), got, atol=2e-5, err_msg=side)


def test_the_recorded_flagembedding_instructions_are_the_pinned_files() -> None:
    prompts = load_reference_module(reference_repo(FLAG), "FlagEmbedding/evaluation/bright/prompts.py")
    assert prompts.BrightShortInstructions == FLAG_BRIGHT_SHORT
    assert prompts.BrightLongInstructions == FLAG_BRIGHT_LONG


# --------------------------------------------------------------------------- ReasonIR


class _ReasonIRRecorder:
    """Stands in for ``AutoModel.from_pretrained(..., trust_remote_code=True)``'s ReasonIR model:
    keeps what ``encode`` is given and returns one vector per text."""

    calls: list[dict[str, Any]] = []
    loaded: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> _ReasonIRRecorder:
        cls.loaded.append((path, kwargs))
        return cls()

    def eval(self) -> _ReasonIRRecorder:
        return self

    def to(self, device: Any) -> _ReasonIRRecorder:
        return self

    def encode(self, texts: list[str], *, instruction: str, batch_size: int, max_length: int) -> np.ndarray:
        self.calls.append({"texts": list(texts), "instruction": instruction, "batch_size": batch_size,
                           "max_length": max_length})
        rng = np.random.default_rng(len(self.calls))
        return rng.normal(size=(len(texts), 4)).astype(np.float32)


def _pairwise_cosine(a, b):  # torchmetrics' pairwise_cosine_similarity, where torchmetrics is absent
    import torch

    return torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T


@pytest.fixture(scope="module")
def diver() -> types.ModuleType:
    import importlib.util

    stubs = {"vllm": stub("vllm"), "vllm.transformers_utils": stub("vllm.transformers_utils"),
             "vllm.transformers_utils.tokenizer": stub("vllm.transformers_utils.tokenizer")}
    if importlib.util.find_spec("torchmetrics") is None:
        stubs.update({"torchmetrics": stub("torchmetrics"), "torchmetrics.functional": stub("torchmetrics.functional"),
                      "torchmetrics.functional.pairwise": stub("torchmetrics.functional.pairwise",
                                                               pairwise_cosine_similarity=_pairwise_cosine)})
    return load_reference_module(reference_repo("AQ-MedAI/Diver"), "Retriever/retrievers.py", stubs=stubs)


def _reasonir_folder() -> Path:
    """ReasonIR's ``evaluation/bright/configs/reasonir/`` in the pinned copy (a failure without it)."""
    root = reference_repo("facebookresearch/ReasonIR")
    folder = root / "evaluation" / "bright" / "configs" / "reasonir"
    if not folder.is_dir():
        pytest.fail(f"the pinned copy {root.name} has no evaluation/bright/configs/reasonir", pytrace=False)
    return folder


def _reasonir_config(key: str) -> dict[str, dict[str, str]]:
    """ReasonIR's ``configs/reasonir/<key>.json``, read from the pinned copy."""
    return json.loads((_reasonir_folder() / f"{key}.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["reasonir-8b", "reasonir-8b-prompt-excluded"])
@pytest.mark.parametrize(("key", "long"), [*((k, False) for k in KEYS), *((k, True) for k in LONG_KEYS)])
def test_reasonirs_bright_function_gives_the_model_what_the_entry_gives_it(
        diver: types.ModuleType, monkeypatch, tmp_path: Path, name: str, key: str, long: bool) -> None:
    monkeypatch.setattr(diver, "AutoModel", _ReasonIRRecorder)
    monkeypatch.setattr(diver, "AutoTokenizer", _ReasonIRRecorder)
    _ReasonIRRecorder.calls, _ReasonIRRecorder.loaded = [], []
    config = _reasonir_config(key)
    instructions = config["instructions_long" if long else "instructions"]
    queries, documents = ["q one", "q two"], ["d one", "d two", "d three"]
    scores = diver.retrieval_reasonir(
        queries=queries, query_ids=["0", "1"], documents=documents, doc_ids=["a", "b", "c"], task=key,
        instructions=instructions, model_id="reasonir", cache_dir=str(tmp_path), excluded_ids={"0": ["b"], "1": ["N/A"]},
        long_context=long)  # run.py's call: no lengths, no batch size (script.sh's BS=-1)
    assert set(scores["0"]) == {"a", "c"} and set(scores["1"]) == {"a", "b", "c"}
    docs_call, query_call = _ReasonIRRecorder.calls
    task = task_name(key, long)
    on = settings_for_task(get_encoder_spec(name), task)
    prefixes = task_prefixes(on, task)
    assert (docs_call["texts"], query_call["texts"]) == (documents, queries)
    assert (query_call["instruction"], docs_call["instruction"]) == (prefixes.query, prefixes.doc)
    assert (query_call["max_length"], docs_call["max_length"]) == (on.max_length_for("query"), on.max_length_for("doc"))
    # ReasonIRModel.encode masks the instruction it is given out of the mean (test_embed_reasonir.py).
    assert on.pool_exclude_prefix and on.pooling == "mean"
    # AutoTokenizer and AutoModel.from_pretrained(checkpoint, torch_dtype="auto", trust_remote_code=True)
    assert [kw for _, kw in _ReasonIRRecorder.loaded] == [{"torch_dtype": "auto", "trust_remote_code": True}] * 2
    assert on.trust_remote_code
    assert on.precision == "bfloat16"  # "auto": the checkpoint's dtype, as the entry records it


def test_the_recorded_reasonir_configs_are_the_pinned_files() -> None:
    folder = _reasonir_folder()
    for key in KEYS:
        config = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
        short, long = REASONIR_QUERY[key]
        assert config["instructions"] == {"query": short, "document": REASONIR_DOC}, key
        assert config.get("instructions_long") == (None if long is None else {"query": long, "document": REASONIR_DOC})


def test_script_argv_keeps_the_quoted_format_whole(tmp_path: Path) -> None:
    # The stand-in python sees what eval gives it: the single-quoted format is one argument with a
    # literal backslash-n (FlagEmbedding's argument class makes it a newline).
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/bash\nargs=\"--fmt 'Instruct: {}\\nQuery: {}' --n 1\"\ncmd=\"python -m x $args\"\neval $cmd\n")
    assert script_argv(script, tmp_path) == [["-m", "x", "--fmt", "Instruct: {}\\nQuery: {}", "--n", "1"]]
