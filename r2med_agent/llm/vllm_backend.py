"""Backend over vLLM's offline engine (``vllm.LLM``), the reference's way of running open models.

The engine is built once per process for a given model and engine settings (with prefix
caching on: the loops resend long shared prefixes), and every ``generate`` call is ONE engine
call over all conversations, which vLLM schedules with continuous batching.

A conversation whose last message is an assistant message is CONTINUED: the model extends that
message's text instead of answering it in a new turn. This is how the reasoning-search loops
re-submit a trajectory's running text, and it is done as the original Search-o1 does it: the
conversation before that message is rendered ONCE by the model's chat template with the
generation prompt (``add_generation_prompt=True``), the running text is appended to it as it is,
and the result goes to ``LLM.generate`` (tokenized without adding special tokens, as
``LLM.chat`` does, since the template already holds them). Re-rendering the running text as an
assistant message (``continue_final_message``) breaks with reasoning models' templates: QwQ and
the DeepSeek-R1 distills open the turn with ``<think>\n`` only in the generation prompt (gone
from step 2 on) and render an assistant message as its text after the last ``</think>`` (the
reasoning is dropped, and ``transformers`` then refuses to continue the message); Qwen3 puts an
empty think block in front of the last assistant message.
:func:`~r2med_agent.llm.continuation.continuation_prompt` renders the prompt. The ``[vllm]``
extra asks for vLLM >= 0.8.5 (Qwen3, ``chat_template_kwargs``).
A batch that mixes new turns and continuations is sent as two engine calls
(``LLM.chat``, then ``LLM.generate``), and the outputs are put back into input order.

With the entry's ``prompt_path: rendered`` a new turn goes the way R2MED's generation script sends
it (``src/generate_hypothetical_doc.py``): the chat template is rendered to a string
(:func:`rendered_prompt`) and the string given to ``LLM.generate``, which tokenizes it WITH the
tokenizer's special tokens, so a template that starts with BOS gets a second one from tokenizers
that add it (Llama-3.1, the DeepSeek-R1 distills; Qwen2.5's adds none, and its ids are the same
either way).

Engines live until :func:`close_engines` (or :meth:`VLLMBackend.close`) shuts them down; the
runner calls it when a run ends, errors included, and an ``atexit`` hook registered when the
first engine starts does it for library users. Without it the process never exits: vLLM stops
its engine process only from a ``weakref.finalize`` hook, and once another library (numba,
through bm25s) has registered weakref's exit hook before multiprocessing's, multiprocessing
joins the still-running engine process first and waits forever.

The entry's ``extra_body`` holds extra ``vllm.SamplingParams`` fields, the same ones a vLLM
server takes in a request's extra body: ``{structured_outputs: {regex: ...}}`` becomes
``StructuredOutputsParams``, so one entry forces the same output offline and over HTTP.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from r2med_agent.errors import ConfigError, LLMError, MissingExtraError
from r2med_agent.llm.base import Finished, PartialBatchError, PromptMeta, TemplateHashes, choice_token_ids
from r2med_agent.llm.continuation import continuation_prompt, continues_final_message
from r2med_agent.llm.registry import LLMSpec, with_system_prompt
from r2med_agent.progress import for_backend
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

_ENGINES: dict[tuple[Any, ...], Any] = {}
_ENGINES_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False

_FINISH = {"stop": "stop", "length": "length", "abort": "error"}


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise MissingExtraError("vllm", "vllm") from None
    return vllm


def engine_kwargs(spec: LLMSpec) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` built from ``spec``."""
    kwargs: dict[str, Any] = {
        "model": spec.model,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "gpu_memory_utilization": spec.gpu_memory_utilization,
        "enable_prefix_caching": True,
    }
    if spec.max_model_len is not None:
        kwargs["max_model_len"] = spec.max_model_len
    if spec.seed is not None:
        kwargs["seed"] = spec.seed
    kwargs.update(spec.engine_kwargs)
    return kwargs


def to_vllm_sampling(
    vllm: Any, params: SamplingParams, extra: dict[str, Any] | None = None, n: int = 1,
    choice_ids: Sequence[int] = (),
) -> Any:
    """Our SamplingParams as ``vllm.SamplingParams``: ``n`` samples (one by default), stop strings
    left out of the output text, the top ``logprobs`` tokens per position when asked; ``extra``
    (the entry's ``extra_body``) adds SamplingParams fields, with a ``structured_outputs``
    mapping turned into ``StructuredOutputsParams``. ``choice_ids`` (the ids of
    ``params.token_choices``) become both ``allowed_token_ids`` and ``logprob_token_ids``, whose
    log-probabilities vLLM returns (its ``logprobs`` must then equal their number)."""
    fields = dict(extra or {})
    structured = fields.get("structured_outputs")
    if isinstance(structured, dict):
        from vllm.sampling_params import StructuredOutputsParams

        fields["structured_outputs"] = StructuredOutputsParams(**structured)
    if params.logprobs:
        fields["logprobs"] = params.logprobs
    if choice_ids:
        fields.update(allowed_token_ids=list(choice_ids), logprob_token_ids=list(choice_ids), logprobs=len(choice_ids))
    return vllm.SamplingParams(
        **fields,
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        seed=params.seed,
        stop=list(params.stop),
        include_stop_str_in_output=False,
        repetition_penalty=params.repetition_penalty,
    )


def rendered_prompt(tokenizer: Any, conversation: list[Message], chat_template_kwargs: dict[str, Any]) -> str:
    """A new turn as R2MED's generation script renders it: the chat template as text, with the
    generation prompt (``prompt_path: rendered``)."""
    return tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


def from_request_output(output: Any, latency_s: float, index: int = 0) -> Generation:
    """Completion ``index`` of a ``vllm.RequestOutput`` as a Generation (text, finish/stop
    reason, token counts, and the top log-probabilities per position when they were asked for)."""
    completion = output.outputs[index]
    stop_reason = completion.stop_reason
    finish = completion.finish_reason or "stop"
    return Generation(
        text=completion.text,
        finish_reason=_FINISH.get(finish, str(finish)),
        # vLLM gives the matched stop string, a stop token id (int) or None (EOS).
        stop_reason=stop_reason if isinstance(stop_reason, str) else None,
        prompt_tokens=len(output.prompt_token_ids or ()),
        completion_tokens=len(completion.token_ids or ()),
        latency_s=latency_s,
        logprobs=_top_logprobs(getattr(completion, "logprobs", None)),
    )


def _top_logprobs(positions: Any) -> tuple[tuple[tuple[str, float], ...], ...] | None:
    """vLLM's per-position ``{token_id: Logprob}`` as ``(token text, logprob)`` pairs by rank
    (vLLM adds the sampled token to the top ones; it is kept where it ranks)."""
    if positions is None:
        return None
    out = []
    for pos in positions:
        items = sorted(pos.values(), key=lambda lp: (lp.rank if lp.rank is not None else 1 << 30, -lp.logprob))
        out.append(tuple((str(lp.decoded_token or ""), float(lp.logprob)) for lp in items))
    return tuple(out)


class VLLMBackend:
    """An :class:`~r2med_agent.llm.base.LLM` over ``vllm.LLM``.

    Attributes:
        spec: the registry entry.
        model_id: the Hugging Face id or path (``spec.model``).
    """

    def __init__(self, spec: LLMSpec) -> None:
        if spec.backend != "vllm":
            raise ConfigError(f"llm '{spec.name}': VLLMBackend needs backend 'vllm'")
        self.spec = spec
        self.model_id = spec.model
        self._key: tuple[Any, ...] | None = None

    def _engine(self) -> Any:
        global _ATEXIT_REGISTERED
        vllm = _import_vllm()
        kwargs = engine_kwargs(self.spec)
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        with _ENGINES_LOCK:
            if key not in _ENGINES:
                check_engine_settings(self.spec)
                logger.info("loading %s into vLLM (%s)", self.spec.model, kwargs)
                if not _ATEXIT_REGISTERED:
                    # Registered before the engine starts, so it runs before multiprocessing's
                    # own exit hook (atexit runs hooks last-registered first).
                    atexit.register(close_engines)
                    _ATEXIT_REGISTERED = True
                try:
                    _ENGINES[key] = vllm.LLM(**kwargs)
                except Exception as e:  # noqa: BLE001 - vLLM raises plain errors on start-up
                    raise startup_error(self.spec, e) from None
            self._key = key
            return _ENGINES[key]

    def close(self) -> None:
        """Shut down this backend's engine (its worker processes exit); a later ``generate``
        starts a new one."""
        key = getattr(self, "_key", None)
        if key is None:
            return
        with _ENGINES_LOCK:
            engine = _ENGINES.pop(key, None)
        self._key = None
        if engine is not None:
            shutdown_engine(engine)

    reports_each = True
    """``generate`` and ``generate_samples`` take ``on_done``, called as each request finishes
    inside the engine call (:data:`~r2med_agent.llm.base.Finished`)."""

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[Generation]:
        """New turns in one ``LLM.chat`` call, continuations in one ``LLM.generate`` call (see
        the module docstring); outputs in input order. The request options are the cache's
        (:class:`~r2med_agent.llm.base.LLM`); ``on_done(i, generation)`` is called as each
        request finishes, while the engine still runs the others (:func:`_reporting`).

        ``latency_s`` of each item is the engine call's wall time since the previous request
        finished (so the items of a call add up to its wall time).
        """
        each = (lambda i, samples: on_done(i, samples[0])) if on_done is not None else None
        return [samples[0] for samples in self.generate_samples(prompts, params, 1, on_done=each)]

    def generate_samples(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int, *,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[list[Generation]]:
        """``n`` samples of each prompt (vLLM's ``n``), in the engine calls of :meth:`generate`;
        ``on_done(i, samples)`` as each prompt's request finishes."""
        if not prompts:
            return []
        vllm = _import_vllm()
        engine = self._engine()
        conversations = [with_system_prompt(list(p), self.spec.system_prompt) for p in prompts]
        choice_ids: list[int] = []
        if params.token_choices:
            tokenizer = engine.get_tokenizer()
            choice_ids = choice_token_ids(lambda s: tokenizer.encode(s, add_special_tokens=False), params.token_choices)
        sampling = to_vllm_sampling(vllm, params, self.spec.extra_body, n, choice_ids)
        progress = for_backend(len(conversations), f"vLLM {self.spec.name}")
        progress.ready()
        bar = progress.vllm_bar
        base_kwargs: dict[str, Any] = {"use_tqdm": bar}
        if self.spec.chat_template_kwargs:
            base_kwargs["chat_template_kwargs"] = dict(self.spec.chat_template_kwargs)
        groups: dict[bool, list[int]] = {False: [], True: []}
        for i, conversation in enumerate(conversations):
            groups[continues_final_message(conversation)].append(i)
        out: list[list[Generation] | None] = [None] * len(conversations)
        failures: dict[int, Exception] = {}
        for continuation, indices in groups.items():
            if not indices:
                continue
            clock = _Clock()

            def report(i: int, output: Any, clock: _Clock = clock) -> None:
                out[i] = [from_request_output(output, clock.lap() / n, j) for j in range(n)]
                if on_done is not None:
                    on_done(i, out[i])

            made = self._group_outputs(engine, [conversations[i] for i in indices], continuation, sampling,
                                       base_kwargs, len(conversations), indices, failures, report)
            share = clock.lap() / (max(sum(out[i] is None for i in made), 1) * n)
            for i, output in made.items():
                if out[i] is None:  # not reported while the engine ran
                    out[i] = [from_request_output(output, share, j) for j in range(n)]
            # Output tokens are known per call (vLLM's own bar shows its running rate).
            progress.update(0, sum(g.completion_tokens for i in made for g in out[i]))  # type: ignore[union-attr]
        progress.close()
        if failures:
            if n == 1:
                raise PartialBatchError([g[0] if g else None for g in out], failures)
            raise next(iter(failures.values()))
        return [g for g in out if g is not None]

    def _group_outputs(
        self, engine: Any, batch: list[list[Message]], continuation: bool, sampling: Any,
        base_kwargs: dict[str, Any], total: int, indices: Sequence[int], failures: dict[int, Exception],
        report: Callable[[int, Any], None] | None = None,
    ) -> dict[int, Any]:
        """One engine call for ``batch`` (new turns or continuations): ``{prompt index: output}``,
        and ``report(prompt index, output)`` as each finishes during the call (:func:`_reporting`).
        A prompt longer than the engine's context fails alone (``failures``, named by its place
        and opening words) and the others are generated: vLLM refuses the whole call otherwise."""
        prompts = self._engine_prompts(engine, batch, continuation)
        config = getattr(getattr(engine, "llm_engine", None), "model_config", None)
        limit = getattr(config, "max_model_len", None)  # None: an engine that does not say (checks nothing)
        lengths = [self._prompt_length(engine, p, c) for p, c in zip(prompts, batch)] if limit else [0] * len(batch)
        keep = [k for k, length in enumerate(lengths) if not limit or length < limit]
        for k in set(range(len(batch))) - set(keep):
            opening = " ".join(str(batch[k][-1].get("content", "")).split())[:40]
            failures[indices[k]] = LLMError(
                f"llm '{self.spec.name}': prompt {indices[k] + 1} of {total} ('{opening}...') has "
                f"{lengths[k]} tokens, longer than the engine's context ({limit}); raise max_model_len "
                "in its llms entry (or shorten the prompt); the other prompts were generated"
            )
        if not keep:
            return {}
        chosen = [prompts[k] for k in keep]
        each = (lambda k, output: report(indices[keep[k]], output)) if report is not None else None
        with _reporting(engine, each):
            if prompts is batch:
                outputs = engine.chat(chosen, sampling, **base_kwargs)
            else:
                outputs = engine.generate(chosen, sampling, use_tqdm=base_kwargs["use_tqdm"])
        if len(outputs) != len(chosen):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(chosen)} prompts")
        return {indices[k]: output for k, output in zip(keep, outputs)}

    def _engine_prompts(self, engine: Any, batch: list[list[Message]], continuation: bool) -> list[Any]:
        """What the engine call takes: the conversations themselves (``LLM.chat``), or, for
        continuations and rendered prompts, the token ids or text given to ``LLM.generate``."""
        if continuation:
            tokenizer = engine.get_tokenizer()
            return [
                {"prompt_token_ids": tokenizer.encode(
                    continuation_prompt(tokenizer, c, self.spec.chat_template_kwargs), add_special_tokens=False,
                )}
                for c in batch
            ]
        if self.spec.prompt_path == "rendered":
            tokenizer = engine.get_tokenizer()
            return [rendered_prompt(tokenizer, c, self.spec.chat_template_kwargs) for c in batch]
        return batch

    def _prompt_length(self, engine: Any, prompt: Any, conversation: list[Message]) -> int:
        """Tokens of one engine prompt, as the engine will count them."""
        if isinstance(prompt, dict):
            return len(prompt["prompt_token_ids"])
        tokenizer = engine.get_tokenizer()
        if isinstance(prompt, str):
            return len(tokenizer.encode(prompt))
        kwargs = dict(self.spec.chat_template_kwargs or {})
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, **kwargs)
        if isinstance(ids, Mapping):  # transformers 5 returns the encoding as a mapping
            ids = ids["input_ids"]
        return len(ids)


class _Clock:
    """Seconds since it was made or since the last :meth:`lap`."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed


@contextlib.contextmanager
def _reporting(engine: Any, report: Callable[[int, Any], None] | None) -> Iterator[None]:
    """While the block makes ONE ``LLM.chat``/``LLM.generate`` call, ``report(k, output)`` is
    called for the k-th prompt of that call as soon as its request finishes, not when the whole
    call returns: the engine's ``add_request`` (which numbers the requests in prompt order) and
    ``step`` (which ``LLM._run_engine`` calls until no request is left, returning the outputs of
    each step) are wrapped on this engine instance for the call's duration. An engine without
    them reports nothing here (its outputs are reported when the call returns). An error
    ``report`` raises does not stop the engine halfway (which would leave its other requests
    queued in it): it is raised when the call returns. Ctrl-C is not caught."""
    llm_engine = getattr(engine, "llm_engine", None)
    add, step = getattr(llm_engine, "add_request", None), getattr(llm_engine, "step", None)
    if report is None or not callable(add) or not callable(step):
        yield
        return
    numbers: dict[str, int] = {}
    errors: list[Exception] = []

    def add_request(request_id: Any, *args: Any, **kwargs: Any) -> Any:
        numbers.setdefault(str(request_id), len(numbers))
        return add(request_id, *args, **kwargs)

    def stepped() -> Any:
        outputs = step()
        for output in outputs:
            k = numbers.get(str(getattr(output, "request_id", "")))
            if k is not None and getattr(output, "finished", False) and not errors:
                try:
                    report(k, output)
                except Exception as e:  # noqa: BLE001 - raised once the engine call is over
                    errors.append(e)
        return outputs

    own = {name: vars(llm_engine)[name] for name in ("add_request", "step") if name in vars(llm_engine)}
    llm_engine.add_request, llm_engine.step = add_request, stepped
    try:
        yield
    finally:
        for name in ("add_request", "step"):
            if name in own:
                setattr(llm_engine, name, own[name])
            else:
                delattr(llm_engine, name)
    if errors:
        raise errors[0]


def shutdown_engine(engine: Any, wait_s: float = 30.0) -> None:
    """Stop a ``vllm.LLM``'s engine processes and wait until they are gone (vLLM 0.32: its
    engine-core client's ``shutdown``; ``LLM.shutdown`` where a version has it).

    vLLM's own shutdown sends SIGTERM, waits a few seconds, then SIGKILLs a core that is still
    running (a CPU engine usually is) and returns without reaping it, so a process could still
    be listed, holding its memory, when the next engine or server starts. Waiting here makes
    "closed" mean "gone"."""
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = list(getattr(manager, "processes", None) or [])  # (vLLM 0.32's process manager)
    try:
        if callable(getattr(engine, "shutdown", None)):
            engine.shutdown()
        elif callable(getattr(core, "shutdown", None)):
            core.shutdown()
    except Exception as e:  # noqa: BLE001 - shutting down must never mask the run's own error
        logger.warning("vLLM engine shutdown failed: %s", e)
    for proc in procs:
        try:
            proc.join(wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        except Exception as e:  # noqa: BLE001
            logger.warning("vLLM engine process %s did not stop: %s", getattr(proc, "pid", "?"), e)


def close_engines() -> None:
    """Shut down every engine this process started (the runner calls it when a run ends; an
    ``atexit`` hook calls it too)."""
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        shutdown_engine(engine)


def _vllm_on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001
        return False


def _memory_bytes() -> tuple[int, int] | None:
    """(total, available) RAM from /proc/meminfo, or None where it cannot be read."""
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
        return info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _gpu_count() -> int | None:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return None


def check_engine_settings(spec: LLMSpec, *, on_cpu: bool | None = None,
                          memory: tuple[int, int] | None = None,
                          gpus: int | None = None) -> None:
    """Refuse settings an engine cannot start with, before starting it (which takes minutes and
    ends in a traceback from another process).

    Raises:
        ConfigError: on a CPU build, ``gpu_memory_utilization`` (there the share of RAM vLLM
            reserves) asks for more than the RAM now available; on GPUs, ``tensor_parallel_size``
            is larger than the GPUs visible.
    """
    on_cpu = _vllm_on_cpu() if on_cpu is None else on_cpu
    if on_cpu:
        memory = _memory_bytes() if memory is None else memory
        if memory is not None:
            total, available = memory
            wanted = spec.gpu_memory_utilization * total
            if wanted > available:
                fits = max(0.01, int(available / total * 0.8 * 100) / 100)
                raise ConfigError(
                    f"llm '{spec.name}': gpu_memory_utilization {spec.gpu_memory_utilization:g} "
                    f"asks vLLM's CPU build for {wanted / 2**30:.1f} GiB of RAM (on CPU it is the "
                    f"share of RAM), but {available / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is "
                    f"available: set gpu_memory_utilization: {fits:g} or lower in the entry (a "
                    f"user config), and size the KV cache with VLLM_CPU_KVCACHE_SPACE (GiB)"
                )
        return
    gpus = _gpu_count() if gpus is None else gpus
    if gpus and spec.tensor_parallel_size > gpus:
        raise ConfigError(
            f"llm '{spec.name}': tensor_parallel_size {spec.tensor_parallel_size} needs "
            f"{spec.tensor_parallel_size} GPUs, but {gpus} are visible: set "
            f"tensor_parallel_size: {gpus} or lower in the entry (a user config), run on a "
            f"machine with more GPUs, or serve the model with vLLM elsewhere and use an "
            f"'openai' entry"
        )


def startup_error(spec: LLMSpec, exc: BaseException) -> LLMError:
    """One message for an engine that failed to start: what vLLM said, and what to set."""
    said = " ".join(str(exc).split()) or type(exc).__name__
    if len(said) > 400:
        said = said[:400] + "..."
    context = spec.max_model_len if spec.max_model_len is not None else "the model's own"
    hints = [
        "gpu_memory_utilization (now "
        f"{spec.gpu_memory_utilization:g}; on a CPU build it is the share of RAM, and "
        "VLLM_CPU_KVCACHE_SPACE sets the KV cache in GiB)",
        f"max_model_len (now {context}; a shorter context "
        "needs less KV cache)",
        f"tensor_parallel_size (now {spec.tensor_parallel_size}; at most the GPUs available)",
    ]
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        hints.append("CUDA_VISIBLE_DEVICES is empty: no GPU is visible")
    return LLMError(
        f"vLLM could not start llm '{spec.name}' ({spec.model}): {type(exc).__name__}: {said}. "
        f"The engine's log above names the cause; the settings that usually fix it, in the "
        f"entry (a user config): " + "; ".join(hints)
    )
