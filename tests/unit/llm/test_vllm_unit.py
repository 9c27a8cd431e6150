"""Issue-11 behaviour that needs no engine: closing backends, start-up messages, seeds,
structured outputs as SamplingParams fields, and generation progress."""

from __future__ import annotations

import io
import sys
import types
from typing import Any

import pytest

from r2med_agent.errors import ConfigError, LLMError
from r2med_agent.llm.registry import LLMSpec
from r2med_agent.progress import GenerationProgress
from r2med_agent.types import SamplingParams
from tests.fakes import ScriptedLLM


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# -- progress -------------------------------------------------------------------------------
def test_plain_progress_lines_at_a_steady_interval_with_rate_eta_and_tokens() -> None:
    clock, out = _Clock(), io.StringIO()  # a StringIO is not a terminal: plain lines
    p = GenerationProgress(10, "vLLM m", stream=out, interval_s=30.0, show=True, clock=clock)
    for _ in range(4):  # 4 generations in 20 s: no line yet
        clock.t += 5.0
        p.update(1, tokens=50)
    assert out.getvalue() == ""
    clock.t += 10.0  # 30 s
    p.update(1, tokens=50)
    assert p.lines == ["vLLM m: 5/10 generations (50%), 0.17/s, ETA 0:00:30, 8.3 output tok/s"]
    clock.t += 10.0
    p.update(5)
    p.close()
    assert p.lines[-1].startswith("vLLM m: 10/10 generations (100%)") and "done in 0:00:40" in p.lines[-1]
    assert out.getvalue().count("\n") == 2 and "\r" not in out.getvalue()


def test_progress_off_with_no_progress_and_for_single_generations() -> None:
    from r2med_agent import progress

    out = io.StringIO()
    assert not GenerationProgress(1, "x", stream=out, show=True).show
    progress.configure(enabled=False)
    try:
        p = GenerationProgress(5, "x", stream=out, interval_s=0.0)
        p.update(5)
        p.close()
        assert p.vllm_bar is False and out.getvalue() == ""
    finally:
        progress.configure(enabled=True)


def test_vllm_bar_feeds_the_progress_and_passes_iterables_through() -> None:
    clock = _Clock()
    p = GenerationProgress(3, "v", stream=io.StringIO(), interval_s=1e9, show=True, clock=clock)
    factory = p.vllm_bar
    items = [1, 2]
    assert factory(items, desc="Rendering prompts") is items  # vLLM's rendering loop
    bar = factory(total=3, desc="Processed prompts", dynamic_ncols=True, postfix="")
    clock.t = 2.0
    bar.update(2)
    bar.postfix = "est. speed input: 1 toks/s"
    assert bar.n == 2 and p.n == 2 and bar.format_dict["elapsed"] == 2.0
    bar.refresh()
    bar.close()


def test_cached_llm_shows_one_progress_over_all_chunks_and_says_what_is_cached(caplog, tmp_path) -> None:
    from r2med_agent.llm.cache.store import GenerationCache
    from r2med_agent.llm.cache.wrapper import CachedLLM

    seen: list[tuple[int, int]] = []

    class Reporting(ScriptedLLM):
        def generate(self, prompts, params, *, sample_index=0, template_hash="", meta=None):  # noqa: ANN001, ANN201
            from r2med_agent.progress import for_backend

            p = for_backend(len(prompts), "x")
            out = super().generate(prompts, params)
            p.update(len(out))
            seen.append((p.n, p.total))
            p.close()  # the shared progress stays open
            return out

    cache = GenerationCache(tmp_path / "c.sqlite")
    llm = CachedLLM(Reporting(lambda m, p: "t " + m[-1]["content"]), "scripted", cache=cache, chunk_size=2)
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
    llm.generate(prompts[:2], SamplingParams())
    caplog.clear()  # only the second call's lines (an earlier CLI test may have set INFO already)
    with caplog.at_level("INFO", logger="r2med_agent.llm.cache.wrapper"):
        llm.generate(prompts, SamplingParams())
    assert seen[-2:] == [(2, 3), (3, 3)]  # one count over the 3 misses, in 2 chunks
    (msg,) = [r.getMessage() for r in caplog.records
              if r.name == "r2med_agent.llm.cache.wrapper" and "generating" in r.getMessage()]
    assert msg == "scripted: generating 3 of 5 texts (2 from the cache) in 2 backend calls"
    caplog.clear()
    with caplog.at_level("INFO", logger="r2med_agent.llm.cache.wrapper"):
        llm.generate(prompts, SamplingParams())  # all cached: no "generating" line
    assert not [r for r in caplog.records if "generating" in r.getMessage()]


def test_progress_counts_chunks_of_backends_that_report_nothing(monkeypatch) -> None:
    from r2med_agent.llm.cache import wrapper as cached
    from r2med_agent.llm.cache import dispatch

    opened: list[GenerationProgress] = []
    real = dispatch.tracking

    def spy(total, desc, **kw):  # noqa: ANN001, ANN202
        kw.update(stream=io.StringIO(), show=True, interval_s=0.0)
        ctx = real(total, desc, **kw)
        progress = ctx.__enter__()
        opened.append(progress)

        class _Ctx:
            def __enter__(self):  # noqa: ANN204
                return progress

            def __exit__(self, *exc):  # noqa: ANN002, ANN204
                return ctx.__exit__(*exc)

        return _Ctx()

    monkeypatch.setattr(dispatch, "tracking", spy)
    llm = cached.CachedLLM(ScriptedLLM(lambda m, q: "t"), "scripted", cache=None, chunk_size=3)
    llm.generate([[{"role": "user", "content": str(i)}] for i in range(4)], SamplingParams())
    (p,) = opened
    assert p.total == 4 and p.n == 4
    assert [line.split(",")[0] for line in p.lines] == ["generating (scripted): 3/4 generations (75%)",
                                                        "generating (scripted): 4/4 generations (100%)"]


# -- closing --------------------------------------------------------------------------------
class _Closable(ScriptedLLM):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_lazy_backend_close_closes_a_built_backend_only() -> None:
    from r2med_agent.llm.cache.wrapper import CachedLLM, LazyBackend

    made: list[_Closable] = []

    def factory() -> _Closable:
        made.append(_Closable(lambda m, p: "t"))
        return made[-1]

    lazy = LazyBackend(factory, "scripted")
    llm = CachedLLM(lazy, "scripted", cache=None)
    llm.close()
    assert made == []  # never built: nothing to close, nothing loaded
    llm.generate([[{"role": "user", "content": "q"}]], SamplingParams())
    llm.close()
    assert made[0].closed == 1 and not lazy.built


@pytest.mark.parametrize("fail", [False, True])
def test_runner_closes_the_llm_it_built_also_on_errors(monkeypatch, tmp_path, fail: bool) -> None:
    import r2med_agent.llm as llm_pkg
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.api import RunConfig, run_experiment

    backend = _Closable(lambda m, p: "fever anemia")
    real_make = llm_pkg.make_llm

    def make_llm(name: str, **kw: Any) -> CachedLLM:
        made = real_make(name, **kw)
        made.backend = backend
        return made

    monkeypatch.setattr(llm_pkg, "make_llm", make_llm)
    if fail:
        from r2med_agent.methods import expansion

        def boom(*a: Any, **k: Any) -> Any:
            raise KeyboardInterrupt  # Ctrl-C mid-run

        monkeypatch.setattr(expansion.HyDE, "to_requests", boom)
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="smollm2", output_dir=tmp_path,
                    show_progress=False, use_cache=False)
    if fail:
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg)
    else:
        run_experiment(cfg)
    assert backend.closed == 1


def test_runner_leaves_an_llm_passed_in_open(tmp_path) -> None:
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.api import RunConfig, run_experiment

    backend = _Closable(lambda m, p: "fever")
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="smollm2", output_dir=tmp_path, show_progress=False)
    run_experiment(cfg, llm=CachedLLM(backend, "scripted", cache=None))
    assert backend.closed == 0


class _Core:
    def __init__(self) -> None:
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


def _fake_vllm(engines: list[Any], fail: Exception | None = None) -> types.ModuleType:
    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            if fail is not None:
                raise fail
            self.llm_engine = types.SimpleNamespace(engine_core=_Core())
            engines.append(self)

    mod = types.ModuleType("vllm")
    mod.LLM = LLM  # type: ignore[attr-defined]
    return mod


def test_vllm_close_shuts_the_engine_core_down_and_atexit_guard_is_registered(monkeypatch) -> None:
    import atexit

    from r2med_agent.llm import vllm_backend

    engines: list[Any] = []
    registered: list[Any] = []
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(engines))
    monkeypatch.setattr(vllm_backend, "_ENGINES", {})
    monkeypatch.setattr(vllm_backend, "_ATEXIT_REGISTERED", False)
    monkeypatch.setattr(vllm_backend, "check_engine_settings", lambda spec: None)
    monkeypatch.setattr(atexit, "register", registered.append)
    spec = LLMSpec(name="v", backend="vllm", model="m")
    a, b = vllm_backend.VLLMBackend(spec), vllm_backend.VLLMBackend(spec)
    assert a._engine() is b._engine()  # one engine per settings
    assert registered == [vllm_backend.close_engines]
    a.close()
    assert engines[0].llm_engine.engine_core.shutdowns == 1 and vllm_backend._ENGINES == {}
    b._engine()  # a new engine after close
    vllm_backend.close_engines()
    assert engines[1].llm_engine.engine_core.shutdowns == 1 and vllm_backend._ENGINES == {}
    assert registered == [vllm_backend.close_engines]  # registered once


def test_shutdown_engine_waits_for_and_kills_an_engine_process_that_outlives_shutdown() -> None:
    """vLLM's shutdown can return while its SIGKILLed core is still listed; closing an engine
    must leave no engine process behind (a real process that ignores the client's shutdown)."""
    import multiprocessing
    import time

    from r2med_agent.llm import vllm_backend

    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), name="EngineCore")
    proc.start()
    try:
        core = _Core()
        core.resources = types.SimpleNamespace(engine_manager=types.SimpleNamespace(processes=[proc]))
        engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core))
        t0 = time.monotonic()
        vllm_backend.shutdown_engine(engine, wait_s=0.5)
        assert core.shutdowns == 1
        assert not proc.is_alive() and proc.exitcode is not None
        assert time.monotonic() - t0 < 30
        assert [p for p in multiprocessing.active_children() if p.name == "EngineCore"] == []
    finally:
        if proc.is_alive():
            proc.kill()


# -- start-up failures ----------------------------------------------------------------------
GiB = 2**30


def test_cpu_memory_share_too_large_is_refused_before_starting() -> None:
    from r2med_agent.llm.vllm_backend import check_engine_settings

    spec = LLMSpec(name="q", backend="vllm", model="m", gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError) as e:
        check_engine_settings(spec, on_cpu=True, memory=(24 * GiB, 20 * GiB))
    msg = str(e.value)
    assert "gpu_memory_utilization 0.9" in msg and "share of RAM" in msg
    assert "set gpu_memory_utilization: 0.66 or lower" in msg and e.value.exit_code == 2
    check_engine_settings(dataclass_replace(spec, gpu_memory_utilization=0.5), on_cpu=True,
                          memory=(24 * GiB, 20 * GiB))


def test_more_gpus_than_visible_is_refused_before_starting() -> None:
    from r2med_agent.llm.vllm_backend import check_engine_settings

    spec = LLMSpec(name="big", backend="vllm", model="m", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 needs 4 GPUs, but 2 are visible"):
        check_engine_settings(spec, on_cpu=False, gpus=2)
    check_engine_settings(spec, on_cpu=False, gpus=4)


def test_engine_start_failure_is_one_message_naming_the_settings(monkeypatch) -> None:
    from r2med_agent.llm import vllm_backend

    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm([], RuntimeError(
        "Engine core initialization failed. See root cause above.")))
    monkeypatch.setattr(vllm_backend, "_ENGINES", {})
    monkeypatch.setattr(vllm_backend, "check_engine_settings", lambda spec: None)
    spec = LLMSpec(name="q", backend="vllm", model="m", max_model_len=4096)
    with pytest.raises(LLMError) as e:
        vllm_backend.VLLMBackend(spec).generate([[{"role": "user", "content": "x"}]], SamplingParams())
    msg = str(e.value)
    assert msg.startswith("vLLM could not start llm 'q' (m): RuntimeError: Engine core initialization failed")
    for setting in ("gpu_memory_utilization (now 0.9", "max_model_len (now 4096", "tensor_parallel_size (now 1"):
        assert setting in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__


def dataclass_replace(spec: LLMSpec, **kw: Any) -> LLMSpec:
    import dataclasses

    return dataclasses.replace(spec, **kw)


# -- structured outputs ---------------------------------------------------------------------
def test_extra_body_becomes_vllm_sampling_fields_with_structured_outputs(monkeypatch) -> None:
    pytest.importorskip("vllm")
    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    from r2med_agent.llm.vllm_backend import to_vllm_sampling

    params = SamplingParams(temperature=0.0, max_tokens=8, seed=None, stop=("</search>",))
    sp = to_vllm_sampling(vllm, params, {"structured_outputs": {"regex": "<search> [a-z]+</search>"}})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams)
    assert sp.structured_outputs.regex == "<search> [a-z]+</search>" and sp.seed is None
    assert to_vllm_sampling(vllm, params).structured_outputs is None
    # Token choices: allowed and scored by their ids, with as many log-probabilities.
    chosen = to_vllm_sampling(vllm, SamplingParams(max_tokens=1, token_choices=(" true", " false")), None, 1, [7, 9])
    assert chosen.allowed_token_ids == [7, 9] == chosen.logprob_token_ids and chosen.logprobs == 2


# -- seeds ----------------------------------------------------------------------------------
def test_seed_option_takes_none() -> None:
    from r2med_agent.cli.run_cmd import parse_seed

    assert parse_seed("none") is None and parse_seed("NULL") is None and parse_seed("7") == 7
    with pytest.raises(ConfigError, match="--seed must be an integer or 'none', got 'x'"):
        parse_seed("x")


def test_cli_seed_none_reaches_the_runner_and_a_bad_seed_exits_2(monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    from r2med_agent.cli import app
    import r2med_agent.api as runner

    seen: list[Any] = []
    monkeypatch.setattr(runner, "run_experiment", lambda cfg, llm=None: seen.append(cfg) or (_ for _ in ()).throw(SystemExit(0)))
    CliRunner().invoke(app, ["run", "--method", "hyde", "--llm", "smollm2", "--task", "sample", "--seed", "none", "-o", str(tmp_path)])
    assert seen and seen[0].sampling == {"seed": None}
    import subprocess

    bad = subprocess.run([sys.executable, "-m", "r2med_agent", "run", "--method", "hyde", "--llm", "smollm2",
                          "--task", "sample", "--seed", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--seed must be an integer or 'none'" in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("method", ["search-r1", "search-o1"])
@pytest.mark.parametrize("entry_seed, cli, sent", [(None, {}, None), (42, {}, 42), (42, {"seed": None}, None), (None, {"seed": 5}, 5)])
def test_loops_send_the_entry_seed_or_the_cli_one(monkeypatch, tmp_path, method, entry_seed, cli, sent) -> None:
    from r2med_agent import config
    from r2med_agent.llm.cache.wrapper import CachedLLM
    from r2med_agent.api import RunConfig, run_experiment

    user = tmp_path / "c.yaml"
    user.write_text(f"llms:\n  s:\n    backend: local\n    model: x.gguf\n    seed: {'null' if entry_seed is None else entry_seed}\n", encoding="utf-8")
    config.set_user_config(user)
    seeds: list[Any] = []

    def script(messages, params):  # noqa: ANN001, ANN202
        seeds.append(params.seed)
        return "<answer>fever</answer>" if method == "search-r1" else "The answer is fever."

    fake = ScriptedLLM(script)
    cfg = RunConfig(tasks=("sample",), method=method, llm="s", output_dir=tmp_path / "r",
                    show_progress=False, sampling=dict(cli))
    run_experiment(cfg, llm=CachedLLM(fake, "scripted", cache=None))
    assert seeds and set(seeds) == {sent}



# -- split environments ---------------------------------------------------------------------
def test_dry_run_flags_rows_whose_llm_and_retriever_need_separate_environments() -> None:
    from r2med_agent.api import ReproduceOptions, load_grid, plan

    def flagged(table: str) -> tuple[int, int, list[Any]]:
        runs = plan(load_grid(table), ReproduceOptions(tasks=("Biology",), generations="fresh"))
        hit = [p for p in runs if p.needs.split]
        return len(hit), len(runs), hit

    n, total, hit = flagged("gar")
    assert (n, total) == (12, 45)  # vLLM LLMs with NV-Embed-v2 (transformers 4.42.4)
    assert all(p.entry.retriever.split("+").count("nv") or p.entry.retriever == "grit" for p in hit)
    assert all(any("or generate first in env 1" in line for line in p.needs.split) for p in hit)
    n, total, hit = flagged("agentic")
    assert (n, total) == (4, 8)
    lines = hit[0].needs.split
    assert lines[0].startswith("SPLIT ENVIRONMENTS: vLLM needs transformers >= 5.16, 'nv' needs transformers==4.42.4")
    assert "python -m vllm.entrypoints.openai.api_server --model" in lines[1]
    assert "backend: openai, server: vllm" in lines[2] and f"--llm {hit[0].entry.llm}-served" in lines[2]
    assert not any("generate first" in line for line in lines)  # loops go over HTTP


@pytest.mark.slow
def test_local_engine_feeds_progress_per_prompt_with_tokens(smollm2_llm) -> None:
    from r2med_agent.progress import tracking

    prompts = [[{"role": "user", "content": f"Say {w}."}] for w in ("one", "two", "three")]
    with tracking(3, "local", stream=io.StringIO(), show=True, interval_s=0.0) as p:
        gens = smollm2_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert p.n == 3 and p.tokens == sum(g.completion_tokens for g in gens) > 0
    assert p.lines[0].startswith("local: 1/3 generations") and "output tok/s" in p.lines[0]


def test_model_loading_does_not_count_in_rate_and_eta() -> None:
    clock = _Clock()
    p = GenerationProgress(4, "v", stream=io.StringIO(), interval_s=0.0, show=True, clock=clock)
    clock.t = 300.0  # five minutes loading the engine
    p.ready()
    clock.t = 310.0
    p.update(2)
    assert p.lines == ["v: 2/4 generations (50%), 0.20/s, ETA 0:00:10"]
    p.ready()  # once work is done, the clock is kept
    assert p.elapsed == 10.0


# -- how a prompt reaches the engine (prompt_path) -------------------------------------------
class _Tokenizer:
    """Renders a conversation the way a chat template does, recording the template options."""

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt, **kwargs):
        assert tokenize is False and add_generation_prompt is True
        self.kwargs.append(kwargs)
        return "<bos>" + "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


class _Engine:
    """Records which engine method got which prompts (``LLM.chat`` or ``LLM.generate``)."""

    def __init__(self) -> None:
        self.tokenizer = _Tokenizer()
        self.calls: list[tuple[str, Any]] = []

    def get_tokenizer(self) -> _Tokenizer:
        return self.tokenizer

    def _outputs(self, n: int) -> list[Any]:
        done = types.SimpleNamespace(text="a passage", finish_reason="stop", stop_reason=None, token_ids=[7],
                                     logprobs=None)
        return [types.SimpleNamespace(prompt_token_ids=[1, 2], outputs=[done]) for _ in range(n)]

    def generate(self, prompts, sampling, use_tqdm=False):
        self.calls.append(("generate", list(prompts)))
        return self._outputs(len(prompts))

    def chat(self, conversations, sampling, **kwargs):
        self.calls.append(("chat", [list(c) for c in conversations]))
        return self._outputs(len(conversations))


@pytest.mark.parametrize("path", ["chat", "rendered"])
def test_prompt_path_rendered_sends_the_template_text_to_generate(monkeypatch, path: str) -> None:
    from r2med_agent.llm import vllm_backend

    engine = _Engine()
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: types.SimpleNamespace(SamplingParams=dict))
    monkeypatch.setattr(vllm_backend.VLLMBackend, "_engine", lambda self: engine)
    spec = LLMSpec(name="m", backend="vllm", model="m", prompt_path=path,  # type: ignore[arg-type]
                   chat_template_kwargs={"enable_thinking": True})
    gens = vllm_backend.VLLMBackend(spec).generate([[{"role": "user", "content": "q"}]], SamplingParams())
    assert [g.text for g in gens] == ["a passage"]
    sent = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "q"}]
    if path == "rendered":  # R2MED's src/generate_hypothetical_doc.py: apply_chat_template, then generate
        assert engine.calls == [("generate", ["<bos><system>You are a helpful assistant.<user>q<assistant>"])]
        assert engine.tokenizer.kwargs == [{"enable_thinking": True}]
    else:
        assert engine.calls == [("chat", [sent])]


def test_prompt_path_is_part_of_the_generation_key_and_set_by_the_run(monkeypatch, tmp_path) -> None:
    import r2med_agent.llm as llm_pkg
    from r2med_agent.llm.cache.wrapper import RequestBuilder, generation_options
    from r2med_agent.api import RunConfig, run_experiment

    chat = LLMSpec(name="m", backend="vllm", model="m")
    rendered = LLMSpec(name="m", backend="vllm", model="m", prompt_path="rendered")
    assert "prompt_path" not in generation_options(chat)  # keys made before the option stay valid
    prompt = [{"role": "user", "content": "q"}]
    assert RequestBuilder.from_spec(chat).key(prompt, SamplingParams()) != RequestBuilder.from_spec(rendered).key(
        prompt, SamplingParams())

    seen: list[Any] = []

    def make_llm(name: str, **kw: Any) -> Any:
        seen.append(kw["overrides"])
        raise KeyboardInterrupt  # stop before any engine

    monkeypatch.setattr(llm_pkg, "make_llm", make_llm)
    for llm_prompt in ("chat", "rendered"):
        cfg = RunConfig(tasks=("sample",), method="hyde", llm="qwen-7b", llm_prompt=llm_prompt,
                        prompts_from="own", output_dir=tmp_path, show_progress=False)  # offline wording
        with pytest.raises(KeyboardInterrupt):
            run_experiment(cfg)
    assert seen == [None, {"prompt_path": "rendered"}]
