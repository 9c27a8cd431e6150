"""torch helpers of the local backends: the torch import, devices, the dtype and autocast a
precision resolves to, and pooling token states into one vector.

torch is imported inside functions; a missing one raises
:class:`~r2med_agent.errors.MissingExtraError` naming the ``cpu`` extra (``gpu`` on CUDA machines).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from r2med_agent.errors import ConfigError, MissingExtraError
from r2med_agent.retrieval.dense.spec import weights_dtype_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

GPU_ALTERNATIVE = "or 'r2med-agent[gpu]' on a CUDA 12 machine, never both"
"""Said after the ``[cpu]`` install command: the two extras ship different faiss builds."""


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingExtraError("torch", "cpu", GPU_ALTERNATIVE) from None
    return torch


def resolve_devices(device: str | None) -> list[str]:
    """``None``/``"cuda"``: every visible GPU (else the CPU); ``"cuda:1"``/``"cpu"``: that one."""
    torch = _import_torch()
    if device is None or device == "cuda":
        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if device == "cuda":
            raise ConfigError("device 'cuda' requested but torch sees no GPU")
        return ["cpu"]
    return [device]


def resolve_dtype(precision: str, device: str) -> Any:
    """The torch dtype the weights load in on ``device`` under ``precision`` (float32 on a CPU)."""
    torch = _import_torch()
    if device.startswith("cpu"):
        return torch.float32
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    name = weights_dtype_name(precision)
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def resolve_autocast(precision: str, device: str) -> Any | None:
    """The ``torch.autocast`` dtype of the forward pass on ``device`` (None: no autocast, e.g. on
    a CPU, where everything runs in float32)."""
    if precision != "autocast-float16" or not device.startswith("cuda"):
        return None
    return _import_torch().float16


def precision_record(precision: str, device: str) -> dict[str, Any]:
    """What a run on ``device`` computes in under ``precision``: ``{"dtype": ...}`` plus
    ``{"autocast": "float16"}`` when the forward pass autocasts (part of embedding cache keys and
    of the results)."""
    rec: dict[str, Any] = {"dtype": str(resolve_dtype(precision, device)).removeprefix("torch.")}
    autocast = resolve_autocast(precision, device)
    if autocast is not None:
        rec["autocast"] = str(autocast).removeprefix("torch.")
    return rec


def pool(hidden: torch.Tensor, mask: torch.Tensor, method: str) -> torch.Tensor:
    """Pool token states ``(B, L, H)`` with attention mask ``(B, L)`` into float32 ``(B, H)``.

    ``mean`` sums in float32 whatever the model's dtype (a bf16 sum over 2,048 tokens keeps about
    three significant digits). ``last-token`` takes the last position whose mask is 1 (right
    padding assumed; with left padding the last position is also the last non-padding token)."""
    torch = _import_torch()
    if method == "cls":
        return hidden[:, 0].float()
    if method == "mean":
        m = mask.to(torch.float32).unsqueeze(-1)
        summed = (hidden.float() * m).sum(dim=1)
        count = m.sum(dim=1).clamp(min=1e-9)
        return summed / count
    if method == "last-token":
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        last = (positions * mask.long()).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    raise ConfigError(f"unknown pooling '{method}'; allowed: cls, mean, last-token, model")
