"""The real-vLLM tier (``-m vllm``): the token ids each ``prompt_path`` sends to the engine.

R2MED's generation script renders the chat template to a string and gives it to ``LLM.generate``,
which tokenizes it with the tokenizer's special tokens; ``LLM.chat`` tokenizes the same text
without them. With a tokenizer that adds a BOS (Llama-3.1, the DeepSeek-R1 distills) the first
way sends it twice. SmolLM2's tokenizer adds none, so the model folder here gets a tokenizer that
puts ``<|endoftext|>`` in front of every text, the way those tokenizers put their BOS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from r2med_agent.types import SamplingParams
from tests.vllm_model import engine_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [{"role": "user", "content": "Write a sentence about fever."}]


def _bos_adding_model(model_dir: Path, dest: Path) -> Path:
    """``model_dir``'s files linked into ``dest`` with a tokenizer that prepends a special token."""
    from tokenizers import Tokenizer, processors

    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "tokenizer.json" and not f.name.startswith("."):
            (dest / f.name).symlink_to(f.resolve())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(dest / "tokenizer.json"))
    return dest


class _Recorder:
    """The real engine, with the prompt token ids of every output it returns recorded."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.prompt_ids: list[list[int]] = []

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def _keep(self, outputs: list[Any]) -> list[Any]:
        self.prompt_ids += [list(o.prompt_token_ids) for o in outputs]
        return outputs

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._keep(self.engine.generate(*args, **kwargs))

    def chat(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self._keep(self.engine.chat(*args, **kwargs))


def test_both_prompt_paths_send_the_expected_token_ids(vllm_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    from r2med_agent.llm import vllm_backend

    folder = _bos_adding_model(vllm_model_dir, tmp_path / "bos-model")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    sent = [{"role": "system", "content": "You are a helpful assistant."}, *PROMPT]
    text = tokenizer.apply_chat_template(sent, tokenize=False, add_generation_prompt=True)
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    with_bos = tokenizer(text)["input_ids"]
    assert with_bos == [tokenizer.convert_tokens_to_ids("<|endoftext|>"), *plain]

    got: dict[str, list[list[int]]] = {}
    try:  # the paths differ in the backend, not the engine: both use one engine, started once
        for path in ("chat", "rendered"):
            spec = engine_spec(folder, max_tokens=4, prompt_path=path)
            backend = vllm_backend.VLLMBackend(spec)
            recorder = _Recorder(backend._engine())
            monkeypatch.setattr(backend, "_engine", lambda recorder=recorder: recorder)
            backend.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, seed=None))
            got[path] = recorder.prompt_ids
        assert len(vllm_backend._ENGINES) == 1
    finally:
        vllm_backend.close_engines()
    assert got == {"chat": [plain], "rendered": [with_bos]}
