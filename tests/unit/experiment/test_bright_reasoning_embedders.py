"""The reasoning embedders of the frontier on BRIGHT's tasks, end to end through the CLI on the
BRIGHT-layout fixture (tests/bright_fixture.py), with tiny random models in the shipped entries'
places: each entry's settings as they are, only the model (and RaDeR's other tokenizer) swapped for
a folder built here. What reaches the model is recorded: the strings and the token limit of
ReasonEmbed's BRIGHT scripts for ``reasonembed-qwen3-8b`` on BRIGHT and of its R2MED scripts on an
R2MED task, and the token ids of RaDeR's own BRIGHT code for ``rader-7b`` on BRIGHT's released GPT-4
reasoning queries. Each query's excluded ids leave the dense rankings as they leave BM25's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.evaluation import read_trec_run
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import get_encoder_spec
from tests.bright_fixture import BIOLOGY_DOCS, BIOLOGY_EXAMPLES, GPT4_REASONING, LEETCODE_DOCS, LEETCODE_EXAMPLES, make_bright
from tests.tiny_embedders import TOKENIZER_STYLES, byte_bpe_tokenizer, tiny_model, user_entry
from tests.bright_embedder_sources import FLAG_BRIGHT_SHORT, FLAG_FORMAT, RADER_QUERY

# VectorSpaceLab/agentic-search@b2f2e40050f4 ReasonEmbed/evaluation_r2med/code/prompts.py (Biology).
R2MED_BIOLOGY = "Given a Biology post, retrieve relevant passages that help answer the post."



@pytest.fixture()
def recorded(monkeypatch) -> list[tuple[str, list[str], int, list[list[int]]]]:
    """(encoder, the full strings, the token limit, the token ids) of every text the models see."""
    seen: list[tuple[str, list[str], int, list[list[int]]]] = []
    real = HFEncoder._tokenize

    def recording(self, lo, texts, titles, max_length):  # noqa: ANN001, ANN202
        out = real(self, lo, texts, titles, max_length)
        seen.append((self.name, list(texts), max_length, [list(x) for x in out[0]]))
        return out

    monkeypatch.setattr(HFEncoder, "_tokenize", recording)
    return seen


def _strings(seen, name: str) -> dict[str, int]:
    return {s: limit for enc, texts, limit, _ in seen if enc == name for s in texts}


def _corpus() -> list[str]:
    return [*FLAG_BRIGHT_SHORT.values(), *BIOLOGY_DOCS.values(), *LEETCODE_DOCS.values(), R2MED_BIOLOGY,
            *(e["query"] for e in BIOLOGY_EXAMPLES), "query: Instruct: ", "document: "]


def test_reasonembed_runs_its_bright_scripts_settings_on_bright_and_its_r2med_ones_on_r2med(
        tmp_path: Path, monkeypatch, recorded, capsys) -> None:
    root = make_bright(tmp_path / "BRIGHT")
    folder = tmp_path / "tiny-qwen3"
    tiny_model("qwen3", folder, byte_bpe_tokenizer(_corpus(), **TOKENIZER_STYLES["qwen3"]))
    entry = user_entry("reasonembed-qwen3-8b", model=str(folder), backend="transformers")
    user = tmp_path / "config.yaml"
    user.write_text(json.dumps({"encoders": {"tiny-reasonembed": entry}}))
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    common = ["--config", str(user), "--retriever", "tiny-reasonembed", "--no-progress", "-o", str(out)]

    code = main(["run", "--task", "bright-biology,bright-leetcode", "--data-dir", str(root), "--top-k", "1000",
                 "--allow-count-mismatch", *common])
    assert code == 0, capsys.readouterr().err
    seen = _strings(recorded, "tiny-reasonembed")
    for key, examples, docs in (("biology", BIOLOGY_EXAMPLES, BIOLOGY_DOCS), ("leetcode", LEETCODE_EXAMPLES, LEETCODE_DOCS)):
        for e in examples:  # FlagEmbedding's BRIGHT instruction of the task, 8,192 tokens
            assert seen.pop(FLAG_FORMAT.format(FLAG_BRIGHT_SHORT[key], e["query"])) == 8192
        for text in docs.values():  # documents as they are, 8,192 tokens
            assert seen.pop(text) == 8192
    assert not seen  # nothing else reached the model
    (folder_out,) = out.glob("none/none/tiny-reasonembed__*")  # a user entry: its hash in the name
    record = json.loads((folder_out / "bright-leetcode.json").read_text())
    assert record["stats"]["excluded_removed"] == 3 and 0.0 <= record["test"]["ndcg_at_10"] <= 1.0
    written = read_trec_run(folder_out / "bright-leetcode.run")
    for e in LEETCODE_EXAMPLES:
        assert not set(e["excluded_ids"]) & set(written[e["id"]])
        assert len(written[e["id"]]) == len(LEETCODE_DOCS) - len([x for x in e["excluded_ids"] if x != "N/A"])

    recorded.clear()
    code = main(["run", "--task", "r2med-demo", *common])
    assert code == 0, capsys.readouterr().err
    queries = [s for enc, texts, limit, _ in recorded for s in texts if s.startswith("Instruct: ")]
    assert queries and all(s.startswith(FLAG_FORMAT.format(R2MED_BIOLOGY, "")) for s in queries)
    assert {limit for _, _, limit, _ in recorded} == {512}  # the R2MED scripts' length


def test_rader_runs_its_own_bright_code_on_the_gpt4_reasoning_queries(
        tmp_path: Path, monkeypatch, recorded, capsys) -> None:
    root = make_bright(tmp_path / "BRIGHT")
    corpus = [*_corpus(), *GPT4_REASONING["biology"].values()]
    # The model's own tokenizer appends <|endoftext|> (gte-Qwen2's); Qwen2.5-Instruct's adds nothing
    # and has <|im_end|> for EOS. One vocabulary.
    own = byte_bpe_tokenizer(corpus, "$A <|endoftext|>", {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    own.eos_token = "<|endoftext|>"
    instruct = byte_bpe_tokenizer(corpus, "$A", {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    instruct.save_pretrained(tmp_path / "instruct-tokenizer")
    folder = tmp_path / "tiny-qwen2"
    tiny_model("qwen2", folder, own)
    shipped = get_encoder_spec("rader-7b")
    entry = user_entry("rader-7b", model=str(folder),
                        bright={**shipped.bright, "hf_tokenizer": str(tmp_path / "instruct-tokenizer")})
    user = tmp_path / "config.yaml"
    user.write_text(json.dumps({"encoders": {"tiny-rader": entry}}))
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code = main(["run", "--task", "bright-biology", "--data-dir", str(root), "--method", "reason", "--llm", "gpt4",
                 "--generations", "bright", "--retriever", "tiny-rader", "--config", str(user), "--top-k", "1000",
                 "--allow-count-mismatch", "--no-progress", "-o", str(out)])
    assert code == 0, capsys.readouterr().err

    im_end = instruct.convert_tokens_to_ids("<|im_end|>")
    instruction = RADER_QUERY["biology"][0].format(task="biology")
    # retrieval_trainedmodel: tokenizer(f"query: {instruction}{query}{eos}"), the reasoning as the query.
    want = {f"query: {instruction}{r}{instruct.eos_token}" for r in GPT4_REASONING["biology"].values()}
    want |= {f"document: {d}{instruct.eos_token}" for d in BIOLOGY_DOCS.values()}
    got = {}
    for _, texts, limit, ids in recorded:
        assert limit == 131072
        for text, x in zip(texts, ids):
            got[text + instruct.eos_token] = x
    assert set(got) == want
    for text, ids in got.items():
        assert ids == instruct(text)["input_ids"] and ids[-1] == im_end and im_end not in ids[:-1]
    (record_file,) = out.glob("reason/gpt4@bright/tiny-rader__*/bright-biology.json")
    record = json.loads(record_file.read_text())
    assert record["stats"]["released_generations"] == 3 and 0.0 <= record["test"]["ndcg_at_10"] <= 1.0
