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
empty think block in front of the last assistant message. :func:`continuation_prompt` shows the
prompt. The ``[vllm]`` extra asks for vLLM >= 0.8.5 (Qwen3, ``chat_template_kwargs``).
A batch that mixes new turns and continuations is sent as two engine calls
(``LLM.chat``, then ``LLM.generate``), and the outputs are put back into input order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.llm.openai_compat import continues_final_message
from r2med_agent.llm.registry import LLMSpec, with_system_prompt
from r2med_agent.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

_ENGINES: dict[tuple[Any, ...], Any] = {}
_ENGINES_LOCK = threading.Lock()

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


def to_vllm_sampling(vllm: Any, params: SamplingParams, n: int = 1) -> Any:
    """Our SamplingParams as ``vllm.SamplingParams``: ``n`` samples (one by default), stop
    strings left out of the output text, the top ``logprobs`` tokens per position when asked."""
    extra: dict[str, Any] = {"logprobs": params.logprobs} if params.logprobs else {}
    return vllm.SamplingParams(
        n=n,
        **extra,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        seed=params.seed,
        stop=list(params.stop),
        include_stop_str_in_output=False,
        repetition_penalty=params.repetition_penalty,
    )


def continuation_prompt(
    tokenizer: Any, conversation: Sequence[Message], chat_template_kwargs: dict[str, Any] | None = None
) -> str:
    """The prompt text that continues the final assistant message of ``conversation``: the
    messages before it rendered by ``tokenizer``'s chat template with the generation prompt,
    then that message's text exactly as it is (see the module docstring)."""
    head = [dict(m) for m in conversation[:-1]]
    rendered = tokenizer.apply_chat_template(
        head, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    return str(rendered) + str(conversation[-1].get("content") or "")


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

    def _engine(self) -> Any:
        vllm = _import_vllm()
        kwargs = engine_kwargs(self.spec)
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        with _ENGINES_LOCK:
            if key not in _ENGINES:
                logger.info("loading %s into vLLM (%s)", self.spec.model, kwargs)
                _ENGINES[key] = vllm.LLM(**kwargs)
            return _ENGINES[key]

    def generate(
        self, prompts: Sequence[list[Message]], params: SamplingParams
    ) -> list[Generation]:
        """New turns in one ``LLM.chat`` call, continuations in one ``LLM.generate`` call (see
        the module docstring); outputs in input order.

        ``latency_s`` of each item is its call's wall time shared evenly over that call.
        """
        return [samples[0] for samples in self.generate_samples(prompts, params, 1)]

    def generate_samples(
        self, prompts: Sequence[list[Message]], params: SamplingParams, n: int
    ) -> list[list[Generation]]:
        """``n`` samples of each prompt (vLLM's ``n``), in the engine calls of :meth:`generate`."""
        if not prompts:
            return []
        vllm = _import_vllm()
        engine = self._engine()
        conversations = [with_system_prompt(list(p), self.spec.system_prompt) for p in prompts]
        sampling = to_vllm_sampling(vllm, params, n)
        base_kwargs: dict[str, Any] = {"use_tqdm": False}
        if self.spec.chat_template_kwargs:
            base_kwargs["chat_template_kwargs"] = dict(self.spec.chat_template_kwargs)
        groups: dict[bool, list[int]] = {False: [], True: []}
        for i, conversation in enumerate(conversations):
            groups[continues_final_message(conversation)].append(i)
        out: list[list[Generation] | None] = [None] * len(conversations)
        for continuation, indices in groups.items():
            if not indices:
                continue
            batch = [conversations[i] for i in indices]
            start = time.perf_counter()
            if continuation:
                tokenizer = engine.get_tokenizer()
                token_prompts = [
                    {"prompt_token_ids": tokenizer.encode(
                        continuation_prompt(tokenizer, c, self.spec.chat_template_kwargs),
                        add_special_tokens=False,
                    )}
                    for c in batch
                ]
                outputs = engine.generate(token_prompts, sampling, use_tqdm=False)
            else:
                outputs = engine.chat(batch, sampling, **base_kwargs)
            share = (time.perf_counter() - start) / (len(batch) * n)
            if len(outputs) != len(batch):
                raise RuntimeError(
                    f"vLLM returned {len(outputs)} outputs for {len(batch)} prompts"
                )
            for i, output in zip(indices, outputs):
                out[i] = [from_request_output(output, share, j) for j in range(n)]
        return [g for g in out if g is not None]
