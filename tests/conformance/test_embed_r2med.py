"""The encoders of the paper grid against R2MED's own dense evaluation (R2MED/R2MED ``src/``):
``eval_retrieval.init_model`` builds each retriever as the paper ran it (``utils.py``'s classes,
their lengths and modes), the per-task statements of ``eval_retrieval.eval_retrieval`` set its
instructions (``instrcution.py``'s tables, keyed by the reference's own task names), and the
classes' ``encode_queries`` / ``encode_corpus`` compose the strings. Compared byte for byte with the
project's strings for the 8 R2MED tasks on the ``sample`` task and hostile texts, with the token
limits where the reference code sets them.

Stubbed, as unavoidable without the models: the loading of weights and tokenizers inside the
classes' constructors (``from_pretrained``, ``SentenceTransformer``, ``GritLM``, the API clients) and
the modules this machine lacks (gritlm, peft, voyageai, mteb). Each class's ``encode`` (or the
model object it calls) is replaced by a recorder of what it is given; everything before it is the
authors' code.
"""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r2med_agent.data.registry import reference_name
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.embedder_inputs import docs, project_doc_strings, queries, task_prefixes

R2MED_TASKS = ("Biology", "Bioinformatics", "Medical-Sciences", "MedXpertQA-Exam", "MedQA-Diag",
               "PMC-Treatment", "PMC-Clinical", "IIYi-Clinical")
# R2MED's retriever names -> the project's entries (R2MED runs MedCPT's article encoder on both sides).
ENTRIES = {"contriever": "contriever", "medcpt": "medcpt-article", "inst-l": "inst-l", "inst-xl": "inst-xl",
           "bmr-410m": "bmr-410m", "bmr-2b": "bmr-2b", "bmr-7b": "bmr-7b", "bge": "bge", "e5": "e5",
           "grit": "grit", "sfr": "sfr", "nv": "nv", "openai": "openai", "voyage": "voyage"}


class _Loaded:
    """Whatever a constructor loads (tokenizer, model, client): accepts every call."""

    pad_token = eos_token = "</s>"
    padding_side = "right"
    max_seq_length = None

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> _Loaded:
        return cls()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def to(self, *args: Any) -> _Loaded:
        return self

    def set_pooling_include_prompt(self, include: bool) -> None:
        self.include_prompt = include


class _Model:
    """The model object Instructor's, GritLM's and NV-Embed's classes call ``encode`` on."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.module = self  # InstructorModel calls self.model.module.encode (DataParallel)

    def eval(self) -> None:
        pass

    def encode(self, sentences: list[str], **kwargs: Any) -> Any:
        import torch

        self.calls.append({"sentences": list(sentences), **kwargs})
        return torch.ones((len(sentences), 2))  # NV-Embed's class normalises a tensor


@pytest.fixture(scope="module")
def reference() -> types.SimpleNamespace:
    folder = reference_repo("R2MED/R2MED")
    import importlib.util

    # Imported before the stubs go in: sentence-transformers asks importlib whether peft exists,
    # which a stub without a module spec cannot answer.
    import sentence_transformers  # noqa: F401

    missing = {name: stub(name) for name in ("gritlm", "peft", "voyageai") if importlib.util.find_spec(name) is None}
    utils = load_reference_module(folder, "src/utils.py", stubs=missing)
    for name in ("AutoTokenizer", "AutoModel", "BertTokenizer", "BertModel", "SentenceTransformer", "GritLM",
                 "OpenAI"):
        setattr(utils, name, _Loaded)  # no weights, no tokenizer files, no API client
    utils.tiktoken = stub("tiktoken", get_encoding=lambda name: _Loaded())
    mteb = {name: stub(name) for name in ("mteb", "mteb.abstasks", "mteb.abstasks.AbsTaskRetrieval")}
    ev = load_reference_module(folder, "src/eval_retrieval.py", stubs={**mteb, "utils": utils})
    instructions = load_reference_module(folder, "src/instrcution.py")
    return types.SimpleNamespace(utils=utils, ev=ev, instructions=instructions, folder=folder)


def _per_task_statements(ev: types.ModuleType) -> list[ast.stmt]:
    """The statements of ``eval_retrieval`` that set a retriever's instructions for a task."""
    tree = ast.parse(inspect.getsource(ev.eval_retrieval))
    found = [node for node in ast.walk(tree) if isinstance(node, ast.If)
             and any(isinstance(t, ast.Attribute) and t.attr.endswith("instruction_for_retrieval")
                     for s in node.body if isinstance(s, ast.Assign) for t in s.targets)]
    assert len(found) == 2, ast.dump(tree)[:200]
    return found


def _authors_build(reference: types.SimpleNamespace, name: str, task: str, tmp: Path) -> Any:
    model = reference.ev.init_model(name, f"model_dir/{name}")
    namespace = {"retrieval_model": model, "retriever_name": name, "task_name": reference_name(task),
                 "query_instruction": reference.instructions.query_instruction,
                 "doc_instruction": reference.instructions.doc_instruction}
    for statement in _per_task_statements(reference.ev):
        exec(compile(ast.Module(body=[statement], type_ignores=[]), "eval_retrieval.py", "exec"), namespace)  # noqa: S102
    for attr in ("cache_path", "query_cache_path", "doc_cache_path"):
        if hasattr(model, attr):
            setattr(model, attr, str(tmp / f"{name}-{task}-{attr}.npy"))  # none exists: nothing is loaded from it
    return model


def _authors_strings(model: Any, qs: list[str], ds: list[str]) -> tuple[list[str], list[str], dict[str, Any]]:
    """The strings the class hands its model for ``qs`` and ``ds`` (corpus entries as the loader
    gives them: ``{"text": ...}``), and the lengths it hands over."""
    recorded: list[list[str]] = []
    lengths: dict[str, Any] = {}
    if isinstance(getattr(model, "model", None), _Loaded) and type(model).__name__ in (
            "InstructorModel", "GritModel", "NVEmbedModel"):
        inner = model.model = _Model()
        model.encode_queries(qs)
        n_query_calls = len(inner.calls)
        model.encode_corpus([{"text": d} for d in ds])
        key = "prompt" if "prompt" in inner.calls[0] else "instruction"
        # sentence-transformers' prompt, GritLM's and NV-Embed's instruction: before the text.
        strings = [[c[key] + s for c in calls for s in c["sentences"]]
                   for calls in (inner.calls[:n_query_calls], inner.calls[n_query_calls:])]
        lengths = {side: {c.get("max_length") for c in calls} for side, calls in
                   (("query", inner.calls[:n_query_calls]), ("doc", inner.calls[n_query_calls:]))}
        return strings[0], strings[1], {side: v.pop() if len(v) == 1 else v for side, v in lengths.items()}

    def record(sentences: list[str], *args: Any, **kwargs: Any) -> np.ndarray:
        recorded.append(list(sentences))
        return np.zeros((len(sentences), 2), dtype=np.float32)

    model.encode = record
    model.encode_queries(qs)
    model.encode_corpus([{"text": d} for d in ds])
    return recorded[0], recorded[-1], {"query": getattr(model, "max_length", None),
                                       "doc": getattr(model, "max_length", None)}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_strings_and_limits_are_r2meds(reference: types.SimpleNamespace, name: str, tmp_path: Path) -> None:
    spec = get_encoder_spec(ENTRIES[name])
    qs, corpus = queries(), docs()
    ds = [d.text for d in corpus]
    for task in R2MED_TASKS:
        model = _authors_build(reference, name, task, tmp_path)
        their_q, their_d, lengths = _authors_strings(model, qs, ds)
        prefixes = task_prefixes(spec, task)
        assert len(their_q) == len(qs) and len(their_d) == len(ds)
        assert [prefixes.query + q for q in qs] == their_q, (name, task)
        assert project_doc_strings(spec, prefixes.doc, corpus) == their_d, (name, task)
        if type(model).__name__ in ("FlagDRESModel", "HighScaleModel", "BiEncoderModel", "GritModel",
                                    "NVEmbedModel"):
            assert (spec.max_length_for("query"), spec.max_length_for("doc")) == (lengths["query"], lengths["doc"])
        if getattr(model, "encode_mode", "") == "BMR":  # max_length - 1 tokens, then the EOS
            assert spec.append_eos
