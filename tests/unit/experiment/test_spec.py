"""The run spec: key / from_key / from_record round-trip over generated specs, one folder per spec,
labels that name what differs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r2med_agent.errors import ConfigError
from r2med_agent.experiment.command import cli_args
from r2med_agent.experiment.resolve import applicable, resolve_spec, spec_of_config
from r2med_agent.experiment.spec import LOOP_RULES, RERANK_RULES, SAMPLING_FLAGS, RunSpec
from r2med_agent.experiment.store import legacy_leaf
from r2med_agent.api import RunConfig


def Spec(**kw) -> RunSpec:  # noqa: N802 - reads as the spec it makes
    """The spec of the run ``kw`` asks for (resolved, as a run resolves it)."""
    return resolve_spec(RunSpec(**kw))

ENCODERS = ["minilm", "bge", "nv", "e5"]


@st.composite
def specs(draw) -> RunSpec:
    """Valid specs over every field, each drawn from values a user can give."""
    method = draw(st.sampled_from(["none", "hyde", "query2doc", "lamer", "search-r1", "search-o1"]))
    agentic = method.startswith("search")
    members = draw(st.lists(st.sampled_from(["bm25", "bm25-compat", *ENCODERS]), min_size=1, max_size=3, unique=True))
    retriever = "+".join(members)
    kw: dict = {"method": method, "retriever": retriever}
    if method != "none":
        kw["llm"] = draw(st.sampled_from(["smollm2", "qwen-7b", "gpt4", "qwq-32b"]))
        kw["generations"] = draw(st.sampled_from(["fresh", "fresh", "r2med"]))
        if kw["generations"] == "fresh":
            sampling = draw(st.fixed_dictionaries({}, optional={
                "temperature": st.floats(0, 2, allow_nan=False).map(lambda x: round(x, 3)),
                "top_p": st.floats(0.05, 1, allow_nan=False).map(lambda x: round(x, 3)),
                "max_tokens": st.integers(1, 20000),
                "seed": st.one_of(st.none(), st.integers(0, 2**31)),
            }))
            kw["sampling"] = sampling
            kw["prompts"] = draw(st.one_of(st.none(), st.text("0123456789abcdef", min_size=16, max_size=16)))
    if method in ("hyde", "query2doc", "lamer"):
        kw["samples"] = draw(st.integers(1, 8))
    if method == "lamer" and kw.get("generations") == "fresh":
        kw["first_pass"] = draw(st.sampled_from(["bm25", "bm25-compat", "minilm"]))
    if len(members) > 1:
        kw["fusion"] = draw(st.sampled_from(["rrf", "weighted"]))
        if kw["fusion"] == "rrf":
            kw["rrf_k"] = draw(st.integers(0, 200))
        else:
            kw["fusion_weights"] = draw(st.one_of(st.none(), st.lists(
                st.floats(0.1, 5, allow_nan=False).map(lambda x: round(x, 2)), min_size=len(members), max_size=len(members)
            ).map(tuple)))
    if agentic:
        kw["final"] = draw(st.sampled_from(["default", "fuse"]))
        if kw["final"] == "default" and kw.get("generations") == "fresh":
            kw["loop_retriever"] = draw(st.one_of(st.none(), st.sampled_from(["bm25", *ENCODERS])))
        if kw.get("generations") == "r2med":
            kw["final"] = "default"
    kw["bm25_k1"] = draw(st.one_of(st.none(), st.floats(0, 3, allow_nan=False).map(lambda x: round(x, 2))))
    kw["bm25_b"] = draw(st.one_of(st.none(), st.floats(0, 1, allow_nan=False).map(lambda x: round(x, 2))))
    kw["precision"] = draw(st.sampled_from([None, "float32", "float16", "bfloat16", "autocast-float16", "auto"]))
    kw["encoder_backend"] = draw(st.sampled_from([None, "auto", "transformers", "vllm"]))
    kw["top_k"] = draw(st.integers(1, 1000))
    if method == "none" and draw(st.booleans()):  # first-stage run files instead of a retriever
        kw.update(retriever="bm25", candidates=draw(st.text("0123456789abcdef", min_size=16, max_size=16)))
        for name in ("fusion", "rrf_k", "fusion_weights"):
            kw.pop(name, None)
    kw["reranker"] = draw(st.sampled_from([None, "monobert", "bge-reranker", "smollm2-listwise", "smollm2-groupwise",
                                          "grouprank-32b"]))
    kw["prompts_from"] = draw(st.sampled_from([None, "own", "authors"]))
    if kw["reranker"]:
        kw["rerank_k"] = draw(st.integers(1, 1000))
        kw["rerank_cut"] = draw(st.booleans())
    kw["exclude_identical_ids"] = draw(st.booleans())
    kw["empty_generation"] = draw(st.sampled_from(["query", "keep"]))
    kw["llm_prompt"] = draw(st.sampled_from(["chat", "rendered"]))
    kw["rerank_max_length"] = draw(st.sampled_from([None, 64, 512, 1024]))
    kw["loop_rules"] = draw(st.sampled_from([1, LOOP_RULES]))  # 1: read from an old record
    return Spec(**kw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_key_and_record_round_trip(spec: RunSpec) -> None:
    assert RunSpec.from_key(spec.key()) == spec
    assert RunSpec.from_record(spec.record()) == spec
    assert RunSpec.from_key(spec.key()).key() == spec.key()
    assert RunSpec.from_key(spec.key()).folder() == spec.folder()
    # The runner records the spec plus run options; the spec read back is the same.
    if spec.loop_rules != LOOP_RULES:  # only results of earlier versions have other loops
        with pytest.raises(ConfigError, match="loop_rules 1 names results of an earlier version"):
            RunConfig(tasks=("sample",), **{f: getattr(spec, f) for f in spec.record()})
        return
    cfg = RunConfig(tasks=("sample",), **{f: getattr(spec, f) for f in spec.record()})
    assert cfg.spec() == spec
    assert RunSpec.from_record(cfg.record()) == spec


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(), specs())
def test_two_specs_share_a_folder_only_when_equal(a: RunSpec, b: RunSpec) -> None:
    assert (a.folder() == b.folder()) == (a.key() == b.key())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_folder_names_are_safe_and_readable(spec: RunSpec) -> None:
    leaf = spec.leaf
    assert "/" not in leaf and len(leaf) <= 170 and leaf == leaf.strip()
    assert leaf.startswith(spec.retriever_name[:50].replace("/", "-")[:10])
    assert spec.digest() in leaf or not spec.settings()
    assert spec.folder().split("/")[:2] == [spec.method, spec.llm_label]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_cli_args_give_the_same_spec(spec: RunSpec) -> None:
    if spec.candidates is not None:  # given by the files' path, which the spec does not hold
        with pytest.raises(ConfigError, match="--candidates"):
            cli_args(spec)
        return
    if spec.loop_rules != LOOP_RULES:  # an earlier version's loops: no option runs them
        with pytest.raises(ConfigError, match="this version does not run"):
            cli_args(spec)
        return
    args = cli_args(spec)
    seen = {a for a in args if a.startswith("--")}
    assert seen <= {"--method", "--llm", "--generations", "--retriever", "--reranker", "--samples", "--first-pass",
                    "--fusion", "--rrf-k", "--fusion-weights", "--loop-retriever", "--final", "--precision",
                    "--encoder-backend", "--top-k", "--rerank-k", "--rerank-cut", "--k1", "--b",
                    "--exclude-identical-ids", "--empty-generation", "--llm-prompt", "--rerank-max-length",
                    "--prompts", *SAMPLING_FLAGS.values()}
    parsed = _parse_run_args(args)
    parsed["prompts"] = spec.prompts  # prompts come from $R2MED_PROMPTS_DIR, not an option
    assert Spec(**parsed) == spec


def _parse_run_args(args: list[str]) -> dict:
    """The spec fields a `run` command line gives: click parses it as `run` does (the options the
    command generates from the spec's fields), without running."""
    import typer

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app
    from r2med_agent.cli.run_cmd import spec_values

    _register()
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    ctx = command.make_context("run", list(args))
    return spec_values(ctx.params)


def test_precision_never_reads_as_a_reranker() -> None:
    # bge__bfloat16 was read back as retriever bge with reranker bfloat16 before the spec.
    spec = Spec(retriever="bge", precision="bfloat16")
    assert spec.label == "none/none/bge [precision=bfloat16]"
    with_reranker = Spec(retriever="bge", precision="bfloat16", reranker="monobert")
    assert with_reranker.label == "none/none/bge/monobert [precision=bfloat16]"
    assert with_reranker.leaf == f"bge__bfloat16__monobert__{with_reranker.digest()}"


def test_settings_that_do_not_apply_neither_split_nor_merge() -> None:
    assert Spec(rerank_k=5) == Spec()  # no reranker: the depth plays no part
    assert Spec(precision="float16") == Spec()  # BM25 has no model
    assert Spec(method="hyde", llm="smollm2", loop_retriever="bge") == Spec(method="hyde", llm="smollm2")
    assert Spec(method="search-r1", llm="x", retriever="bge", loop_retriever="bge").loop_retriever is None
    assert Spec(method="hyde", llm="smollm2", sampling={"temperature": 1}) == Spec(
        method="hyde", llm="smollm2", sampling={"temperature": 1.0})
    assert Spec(method="hyde", llm="smollm2", sampling={"temperature": 0.9}) != Spec(method="hyde", llm="smollm2")


def test_reference_options_apply_only_where_they_play_a_part() -> None:
    # the identical-id exclusion needs a dense retriever; the empty-generation policy an LLM;
    # the prompt path fresh generations of a vllm entry (qwen-7b is one, gpt4 and smollm2 are not)
    assert Spec(exclude_identical_ids=True) == Spec()
    assert Spec(retriever="bm25-compat", exclude_identical_ids=True) == Spec(retriever="bm25-compat")
    nv = Spec(retriever="nv", exclude_identical_ids=True)
    assert nv.exclude_identical_ids and nv.leaf == f"nv__noself__{nv.digest()}"
    assert Spec(retriever="bm25+nv", exclude_identical_ids=True).exclude_identical_ids
    assert Spec(empty_generation="keep") == Spec()
    hyde = Spec(method="hyde", llm="qwen-7b", empty_generation="keep", llm_prompt="rendered")
    assert hyde.settings() == {"empty_generation": "keep", "llm_prompt": "rendered"}
    assert "empty-keep" in hyde.leaf and "prompt-rendered" in hyde.leaf
    released = Spec(method="hyde", llm="qwen-7b", generations="r2med", llm_prompt="rendered")
    assert released == Spec(method="hyde", llm="qwen-7b", generations="r2med")
    for llm in ("gpt4", "smollm2"):
        assert Spec(method="hyde", llm=llm, llm_prompt="rendered").llm_prompt == "chat"
    # a cross-encoder's input length: set back where it is the entry's own or there is none
    assert Spec(retriever="nv", reranker="rankllama", rerank_max_length=1024) == Spec(retriever="nv", reranker="rankllama")
    assert Spec(retriever="nv", rerank_max_length=512) == Spec(retriever="nv")
    assert Spec(retriever="nv", reranker="smollm2-listwise", rerank_max_length=512).rerank_max_length is None
    released = Spec(retriever="nv", reranker="rankllama", rerank_max_length=512)
    assert released.settings() == {"rerank_max_length": 512} and "rml512" in released.leaf
    with pytest.raises(ConfigError, match="--empty-generation must be one of query, keep"):
        Spec(method="hyde", llm="qwen-7b", empty_generation="skip")
    with pytest.raises(ConfigError, match="--llm-prompt must be one of chat, rendered"):
        Spec(method="hyde", llm="qwen-7b", llm_prompt="generate")


def test_a_record_without_loop_rules_is_of_the_earlier_loops() -> None:
    # Every record this version writes holds loop_rules; one without it was written before the
    # agentic loops followed the originals' code, so its run is another spec with its own folder.
    new = Spec(method="search-o1", llm="qwen3-32b", retriever="bge")
    record = new.record()
    assert record["loop_rules"] == LOOP_RULES == 3 and RunSpec.from_record(record) == new
    del record["loop_rules"]
    old = spec_of_config(record)
    assert old.loop_rules == 1 and old.key() != new.key() and old.folder() != new.folder()
    assert old.leaf == f"bge__loops-v1__{old.digest()}" and old.label == "search-o1/qwen3-32b/bge [loop_rules=1]"
    assert new.folder() == "search-o1/qwen3-32b/bge" and new.settings() == {}
    assert RunSpec.from_key(old.key()) == old and RunSpec.from_key(new.key()) == new  # a key leaves defaults out
    assert "loop_rules" in applicable(new)
    r1 = Spec(method="search-r1", llm="qwen-3b-ins", retriever="nv").record()
    del r1["loop_rules"]
    assert spec_of_config(r1).loop_rules == 1
    # No loop ran: other methods, and the agentic methods' released generations.
    for spec in (Spec(method="hyde", llm="qwen-7b"), Spec(), Spec(retriever="nv", reranker="monobert"),
                 Spec(method="search-o1", llm="qwq-32b", retriever="bge", generations="r2med")):
        record = spec.record()
        del record["loop_rules"]
        assert spec_of_config(record) == spec and spec_of_config(record).folder() == spec.folder()
    assert Spec(method="hyde", llm="qwen-7b", loop_rules=1) == Spec(method="hyde", llm="qwen-7b")
    assert "loop_rules" not in applicable(Spec(method="hyde", llm="qwen-7b"))
    with pytest.raises(ConfigError, match="loop_rules must be a loop version from 1 to 3"):
        Spec(method="search-o1", llm="qwen3-32b", loop_rules=4)


def test_a_record_of_the_single_qa_search_o1_keeps_its_version() -> None:
    # Version 2 gave Search-o1 the single-QA instruction with 10 searches; its records hold
    # loop_rules 2, so they read back as their own run, never as today's multi-hop setting.
    new = Spec(method="search-o1", llm="qwen3-32b", retriever="bge")
    record = {**new.record(), "loop_rules": 2}
    old = spec_of_config(record)
    assert old.loop_rules == 2 and old.key() != new.key() and old.folder() != new.folder()
    assert old.leaf == f"bge__loops-v2__{old.digest()}" and old.label == "search-o1/qwen3-32b/bge [loop_rules=2]"
    assert RunSpec.from_key(old.key()) == old
    with pytest.raises(ConfigError, match="loop_rules 2 names results of an earlier version"):
        cli_args(old)
    from r2med_agent.api import RunConfig

    with pytest.raises(ConfigError, match="this version runs only loop_rules 3"):
        RunConfig(tasks=("sample",), method="search-o1", llm="smollm2", loop_rules=2)


def test_default_runs_keep_their_folder_names() -> None:
    # Results of default runs written before spec.json are already in their own folders.
    for spec in (Spec(), Spec(method="hyde", llm="smollm2"), Spec(retriever="bm25+minilm"),
                 Spec(retriever="nv", reranker="monobert"), Spec(method="hyde", llm="qwen-7b", generations="r2med")):
        assert spec.leaf == legacy_leaf(spec)
        assert "__" not in spec.leaf or spec.reranker


@pytest.mark.parametrize("kw, message", [
    ({"method": "hyde"}, "needs --llm"),
    ({"llm": "smollm2"}, "only used by a method"),
    ({"rerank_cut": True}, "--rerank-cut needs --reranker"),
    ({"method": "search-r1", "llm": "x", "samples": 2}, "--samples applies to hyde, query2doc, lamer and reason"),
    ({"method": "hyde", "llm": "x", "first_pass": "bm25-compat"}, "--first-pass is LameR's"),
    ({"method": "hyde", "llm": "x", "sampling": {"top_p": 0}}, "--top-p must be in"),
])
def test_bad_specs_name_the_option(kw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Spec(**kw)


def test_a_bad_key_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="not a run spec key"):
        RunSpec.from_key("{nope")


def test_prompt_folders_are_part_of_the_identity(tmp_path: Path, monkeypatch) -> None:
    from r2med_agent.paths import prompts_dir

    shipped = RunConfig(tasks=("sample",), method="hyde", llm="smollm2")
    assert shipped.prompts is None
    mine = tmp_path / "mine"
    (mine / "hyde").mkdir(parents=True)
    (mine / "hyde" / "qa.j2").write_text((prompts_dir() / "hyde" / "qa.j2").read_text() + "\nBe brief.")
    monkeypatch.setenv("R2MED_PROMPTS_DIR", str(mine))
    custom = RunConfig(tasks=("sample",), method="hyde", llm="smollm2")
    assert custom.prompts is not None and custom.folder() != shipped.folder()
    assert custom.label.endswith(f"[prompts={custom.prompts}]")
    # The same files elsewhere are the same prompts; plain retrieval renders none.
    other = tmp_path / "copy"
    (other / "hyde").mkdir(parents=True)
    (other / "hyde" / "qa.j2").write_bytes((mine / "hyde" / "qa.j2").read_bytes())
    monkeypatch.setenv("R2MED_PROMPTS_DIR", str(other))
    assert RunConfig(tasks=("sample",), method="hyde", llm="smollm2").prompts == custom.prompts
    assert RunConfig(tasks=("sample",)).prompts is None


def test_a_name_cut_for_length_keeps_specs_apart() -> None:
    # Fusion weights are part of the readable name; past 150 characters it is cut, and the
    # digest then keeps two fusions that differ only in their last weight apart.
    members = "+".join(["bm25", "minilm", "bge", "nv", "e5", "grit", "sfr", "contriever", "medcpt", "inst-l",
                        "inst-xl", "bmr-7b"])
    a = Spec(retriever=members, fusion="weighted", fusion_weights=(0.123456,) * 11 + (0.2,))
    b = Spec(retriever=members, fusion="weighted", fusion_weights=(0.123456,) * 11 + (0.3,))
    assert a.leaf != b.leaf and a.leaf.endswith(a.digest()) and len(a.leaf) <= 160


def test_a_record_without_rerank_rules_is_of_the_earlier_rerankers() -> None:
    # A published LLM reranker's run recorded before the rerankers followed their authors' code
    # (no rerank_rules) is another spec, with its own folder; `run` refuses to make one.
    new = Spec(retriever="diver-4b", reranker="grouprank-32b")
    record = new.record()
    assert record["rerank_rules"] == RERANK_RULES == 3 and RunSpec.from_record(record) == new
    del record["rerank_rules"]
    old = spec_of_config(record)
    assert old.rerank_rules == 1 and old.folder() != new.folder() and "rerank-v1" in old.leaf
    assert RunSpec.from_key(old.key()) == old and RunSpec.from_key(new.key()) == new
    assert "rerank_rules" in applicable(new)
    with pytest.raises(ConfigError, match="rerank_rules 1 names results of an earlier version's rerankers"):
        cli_args(old)
    from r2med_agent.api import RunConfig

    with pytest.raises(ConfigError, match="this version runs only rerank_rules 3"):
        RunConfig(tasks=("sample",), reranker="grouprank-32b", rerank_rules=1)
    for name in ("reasonrank-7b", "rank-r1-14b", "rank1-7b", "qwen3-32b-groupwise"):
        rec = Spec(reranker=name).record()
        del rec["rerank_rules"]
        assert spec_of_config(rec).rerank_rules == 1, name
    # Nothing of theirs ran: no reranker, a cross-encoder, the project's own LLM prompts.
    for spec in (Spec(), Spec(retriever="nv", reranker="monobert"), Spec(reranker="smollm2-listwise"),
                 Spec(method="hyde", llm="qwen-7b")):
        rec = spec.record()
        del rec["rerank_rules"]
        assert spec_of_config(rec) == spec and "rerank_rules" not in applicable(spec)


def test_a_record_of_rerank_rules_2_keeps_its_version() -> None:
    # Version 2 wrote Rank-R1's imported prompt as "[i] text" and shuffled GroupRank's groups in
    # the task's query order; its records hold rerank_rules 2 and read back as their own runs.
    for name in ("rank-r1-14b", "grouprank-32b"):
        new = Spec(retriever="diver-4b", reranker=name)
        old = spec_of_config({**new.record(), "rerank_rules": 2})
        assert old.rerank_rules == 2 and old.folder() != new.folder() and "rerank-v2" in old.leaf, name
        assert old.label.endswith(" [rerank_rules=2]") and not new.label.endswith("]"), (name, old.label)
        assert RunSpec.from_key(old.key()) == old


def test_a_gpt4_record_without_request_rules_is_of_the_earlier_request() -> None:
    # GPT-4o's entry sent max_tokens 10240 and seed 42 before it sent what R2MED's script sends;
    # its fresh generations recorded then lack request_rules and are another run.
    from r2med_agent.experiment.spec import REQUEST_RULES

    new = Spec(method="hyde", llm="gpt4")
    record = new.record()
    assert record["request_rules"] == REQUEST_RULES == 2 and "request_rules" in applicable(new)
    del record["request_rules"]
    old = spec_of_config(record)
    assert old.request_rules == 1 and old.folder() != new.folder() and "request-v1" in old.leaf
    assert old.label == "hyde/gpt4/bm25 [request_rules=1]" and new.folder() == "hyde/gpt4/bm25"
    with pytest.raises(ConfigError, match="request_rules 1 names results of an earlier version's requests"):
        cli_args(old)
    from r2med_agent.api import RunConfig

    with pytest.raises(ConfigError, match="this version runs only request_rules 2"):
        RunConfig(tasks=("sample",), method="hyde", llm="gpt4", request_rules=1)
    # Entries that do not declare it, released generations and runs without an LLM keep theirs.
    for spec in (Spec(method="hyde", llm="qwen-7b"), Spec(method="hyde", llm="gpt4", generations="r2med"), Spec(),
                 Spec(method="hyde", llm="o3-mini")):
        rec = spec.record()
        del rec["request_rules"]
        assert spec_of_config(rec) == spec and "request_rules" not in applicable(spec), spec
