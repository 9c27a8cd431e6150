"""sentence-transformers as an independent reference for last-token encoders (harrier's recipe):
Transformer -> Pooling(lasttoken) -> Normalize, with named prompts, across the library's versions
(the module path and the dimension getter were renamed in 6.x)."""

from __future__ import annotations

from pathlib import Path


def last_token_model(folder: Path, prompts: dict[str, str], max_seq_length: int):
    """A SentenceTransformer over the model in ``folder``, pooling the last token, L2-normalised."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Normalize, Pooling, Transformer

    body = Transformer(str(folder), max_seq_length=max_seq_length)
    dim = body.get_embedding_dimension() if hasattr(body, "get_embedding_dimension") else body.get_word_embedding_dimension()
    return SentenceTransformer(
        modules=[body, Pooling(dim, pooling_mode="lasttoken"), Normalize()], prompts=prompts, device="cpu"
    )
