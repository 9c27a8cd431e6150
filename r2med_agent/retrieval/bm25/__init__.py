"""BM25 over a task's corpus: the ``bm25`` (Lucene 9, to the bit) and ``bm25-compat`` (R2MED's
gensim scoring) retrievers, with an on-disk index reused across runs.

One job per module (import from the module that holds a name):

* :mod:`~r2med_agent.retrieval.bm25.tokenizer`: Lucene's ``StandardTokenizer`` and Java's
  lowercasing (:func:`tokenize`, :func:`java_lower`).
* :mod:`~r2med_agent.retrieval.bm25.porter`: Lucene's Porter stemmer (:func:`lucene_porter_stem`).
* :mod:`~r2med_agent.retrieval.bm25.analysis`: pyserini's default English analyzer
  (:class:`LuceneEnglishAnalyzer`, :class:`AnalyzedTexts`, ``ENGLISH_STOP_WORDS``).
* :mod:`~r2med_agent.retrieval.bm25.index`: the saved index, its folder name (:func:`index_key`),
  saving and loading.
* :mod:`~r2med_agent.retrieval.bm25.ranking`: what both scorings share (postings, bags of words,
  the top ``k`` in trec_eval's order).
* :mod:`~r2med_agent.retrieval.bm25.lucene`: Lucene's ``BM25Similarity`` (``length_to_norm``,
  ``norm_to_length``, ``lucene_idf``, ``lucene_norm_inverse`` and its index).
* :mod:`~r2med_agent.retrieval.bm25.pruning`: the lucene scoring's top-``k`` search that skips
  what cannot enter the top ``k`` (MaxScore; compiled with numba when installed).
* :mod:`~r2med_agent.retrieval.bm25.compat`: R2MED's gensim ``LuceneBM25Model`` scoring.
* :mod:`~r2med_agent.retrieval.bm25.retriever`: :class:`BM25Retriever`, :class:`BM25Options`,
  ``MODES``, ``DEFAULT_K1``, ``DEFAULT_B``.

A request's query text (its ``combine`` rule) is :func:`r2med_agent.retrieval.query.bm25_query_text`.
"""
