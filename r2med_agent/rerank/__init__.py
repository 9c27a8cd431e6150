"""Rerankers: re-score the top of a first-stage run.

One job per module (import from the module that holds a name):

* :mod:`~r2med_agent.rerank.kinds`: :data:`RERANKER_KINDS`, each kind's builder and
  declared capabilities (``uses_llm``, ``has_model``, ``batches_tasks``, ``prompt_folder``, ...);
  a new kind is one module and one line there.
* :mod:`~r2med_agent.rerank.spec`: the registry entry :class:`RerankerSpec`
  (``configs/rerankers.yaml``), checked against its kind's declarations,
  :func:`reranker_registry`, :func:`get_reranker_spec` and the :class:`Reranker` protocol
  (``name``, ``batches_tasks``, ``check()``, ``rerank(requests, run, corpus, k)``).
* :mod:`~r2med_agent.rerank.cross_encoder`: :class:`PairwiseReranker`, cross-encoders
  and RankLLaMA on transformers or vLLM (:func:`check_model_files`, :func:`merge_adapter`).
* :mod:`~r2med_agent.rerank.llm`: :class:`LLMReranker` (listwise and pointwise
  reasoning; ``batches_tasks`` True, ``rerank_tasks(jobs, k)`` over :class:`RerankJob`), and the
  pure parts it is made of (:func:`window_positions`, :func:`parse_permutation`,
  :func:`parse_judgment`, :func:`yes_probability`).
* :mod:`~r2med_agent.rerank.formats`: the published formats an LLM entry's ``format``
  selects (ReasonRank, InsertRank, Rank1): system message, answer reading, P(true).
* :mod:`~r2med_agent.rerank.groupwise`: :class:`GroupwiseReranker` (GroupRank: groups
  of candidates scored 0-10, averaged over seeded passes; :func:`parse_group_scores`), and
  :class:`JobReranker`, the setup it shares with the setwise reranker.
* :mod:`~r2med_agent.rerank.setwise`: :class:`SetwiseReranker` (Rank-R1: the best of
  small sets, llm-rankers' heap sort, :func:`heapsort_selection`).
* :mod:`~r2med_agent.rerank.tokens`: passages (and Rank-R1's query) cut to tokens of the
  reranker's LLM's own tokenizer, and ReasonRank's ftfy repair.
* :mod:`~r2med_agent.rerank.factory`: :func:`make_reranker`, an entry's reranker built
  by its kind (also :func:`r2med_agent.retrieval.make_reranker`), and the built-in kinds' builders.

NanoR2MED's shipped candidate lists, which rerankers often start from, are first-stage retrievers:
:mod:`r2med_agent.retrieval.candidates`.
"""
