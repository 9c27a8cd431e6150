"""Dense retrieval: text encoders and exact cosine search over cached document embeddings.

One job per module (import from the module that holds a name):

* :mod:`~r2med_agent.retrieval.dense.spec`: the registry entry :class:`EncoderSpec`
  (``configs/encoders.yaml``), the run's :class:`EncoderOptions`, the :class:`Encoder` protocol,
  ``PRECISIONS`` and ``BACKENDS``.
* :mod:`~r2med_agent.retrieval.dense.instructions`: the per-task instruction prefixes.
* :mod:`~r2med_agent.retrieval.dense.models`: model paths, fingerprints, loading and the
  transformers version check.
* :mod:`~r2med_agent.retrieval.dense.torch_utils`: devices, dtypes and autocast of a precision,
  pooling.
* :mod:`~r2med_agent.retrieval.dense.tokens`: the token ids both local backends embed.
* :mod:`~r2med_agent.retrieval.dense.hf`, :mod:`~r2med_agent.retrieval.dense.vllm`,
  :mod:`~r2med_agent.retrieval.dense.api`: the backends (transformers, vLLM's pooling engine,
  OpenAI-compatible embedding APIs); ``vllm`` also picks between the local two.
* :mod:`~r2med_agent.retrieval.dense.factory`: :func:`make_encoder`, an entry's encoder on its backend.
* :mod:`~r2med_agent.retrieval.dense.cache`: document embeddings and their on-disk cache.
* :mod:`~r2med_agent.retrieval.dense.index`: query embeddings, the faiss index and
  :class:`DenseRetriever`.
"""
