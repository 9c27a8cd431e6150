"""r2med-agent: reasoning-augmented medical retrieval on the R2MED benchmark."""

__version__ = "0.1.0"

from r2med_agent.api import evaluate_encoder, evaluate_llm, evaluate_retriever  # noqa: E402

__all__ = ["__version__", "evaluate_encoder", "evaluate_llm", "evaluate_retriever"]
