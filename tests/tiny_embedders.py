"""Tiny stand-ins for the reasoning embedders, built offline in a test: a real byte-level BPE
tokenizer (every byte changes the ids, so a wrong instruction, a missing space or a wrong cut
shows) with the special tokens and post-processing of a model family, and a random model of the
family's architecture class saved beside it. Used by the unit tests of the encoder entries and by
the conformance suite, which runs the authors' own code on the same folders."""

from __future__ import annotations

import dataclasses
import json

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Special tokens and post-processing of the stand-in tokenizers: Qwen-style (no BOS; the
# Qwen3-Embedding tokenizers append <|endoftext|>, which is also their pad token), Llama-3-style
# (BOS in front, nothing after).
TOKENIZER_STYLES: dict[str, dict[str, Any]] = {
    "qwen3": dict(template="$A <|endoftext|>", specials={"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "qwen2": dict(template="$A", specials={"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "llama": dict(template="<|begin_of_text|> $A", specials={
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|finetune_right_pad_id|>"}),
}


def byte_bpe_tokenizer(corpus: Iterable[str], template: str, specials: dict[str, str], vocab_size: int = 400):
    """A real byte-level BPE tokenizer trained on ``corpus`` (any text encodes: unknown
    characters fall back to their bytes), with ``specials`` and the post-processing ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    names = list(dict.fromkeys(specials.values()))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=names, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    used = [t for t in names if t in template]
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, tok.token_to_id(t)) for t in used])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def tiny_model(arch: str, folder: Path, tok: Any, head_dim: int = 8, positions: int = 256):
    """A random model of the architecture class, saved with ``tok`` in ``folder``; returns it and
    the tokenizer as ``AutoTokenizer`` loads it back from there (as FlagEmbedding and the encoder
    load it: transformers may pick the architecture's own tokenizer class). Two attention heads of
    ``head_dim`` (vLLM's CPU attention takes 32 and up)."""
    import torch
    import transformers

    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3Model),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2Model),
        "llama": (transformers.LlamaConfig, transformers.LlamaModel),
    }[arch]
    extra = {"head_dim": head_dim} if arch == "qwen3" else {}
    cfg = config_cls(vocab_size=len(tok), hidden_size=2 * head_dim, intermediate_size=4 * head_dim,
                     num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **extra)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    assert type(transformers.AutoModel.from_pretrained(folder)).__name__ == model_cls.__name__
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def user_entry(name: str, **changes: Any) -> dict:
    """A shipped encoder entry as a user config writes it (JSON is YAML): its fields that differ
    from the defaults, with ``changes``; nested mappings (a ``bright:`` block) as plain dicts."""
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    spec = dataclasses.replace(get_encoder_spec(name), **changes)
    out = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name == "name" or value is None or (f.default is not dataclasses.MISSING and value == f.default):
            continue
        out[f.name] = json.loads(json.dumps(value, default=dict)) if hasattr(value, "items") else (
            list(value) if isinstance(value, tuple) else value)
    return out
