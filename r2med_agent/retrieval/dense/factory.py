"""The encoder of a registry entry on the backend it runs on (:func:`make_encoder`)."""

from __future__ import annotations

from r2med_agent.retrieval.dense.api import APIEncoder
from r2med_agent.retrieval.dense.hf import HFEncoder
from r2med_agent.retrieval.dense.spec import Encoder, EncoderOptions, EncoderSpec, get_encoder_spec
from r2med_agent.retrieval.dense.vllm import VLLMEncoder, resolve_backend


def make_encoder(spec: EncoderSpec | str, options: EncoderOptions | None = None) -> Encoder:
    """Build the encoder of a registry entry (models load lazily, on the first ``encode``).

    ``options`` (None: the defaults without progress bars) give the device, a precision that
    overrides the entry's, and the backend (``auto``, ``transformers``, ``vllm``; None: the
    entry's ``backend``) that picks the engine of an ``hf`` entry
    (:func:`~r2med_agent.retrieval.dense.vllm.resolve_backend`)."""
    options = options or EncoderOptions(show_progress=False)
    if isinstance(spec, str):
        spec = get_encoder_spec(spec)
    spec = options.apply_to(spec)
    chosen = resolve_backend(spec, options.backend, options.device)
    if chosen == "api":
        return APIEncoder(spec, show_progress=options.show_progress)
    if chosen == "vllm":
        return VLLMEncoder(spec, device=options.device, show_progress=options.show_progress)
    return HFEncoder(spec, device=options.device, show_progress=options.show_progress)
