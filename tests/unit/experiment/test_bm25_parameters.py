"""BM25's k1 and b are run settings: `run --k1 --b` scores as gensim's LuceneBM25Model (R2MED's
reference BM25) with the same parameters, and each pair of values has its own result folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from r2med_agent.cli.app import main
from r2med_agent.data import load_task
from r2med_agent.evaluation import read_trec_run
from r2med_agent.experiment.resolve import resolve_spec
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.retrieval.bm25.analysis import LuceneEnglishAnalyzer
from tests.unit.retrieval.test_bm25 import analyzed_corpus, assert_ranking


def test_k1_and_b_reach_the_scoring_and_the_folder(tmp_path: Path) -> None:
    pytest.importorskip("gensim")
    from gensim.corpora import Dictionary
    from gensim.models import LuceneBM25Model
    from gensim.similarities import SparseMatrixSimilarity

    out = tmp_path / "results"
    for k1, b in (("1.2", "0.75"), ("0.9", "0.4"), ("2.0", "0.1")):
        assert main(["run", "--retriever", "bm25-compat", "--k1", k1, "--b", b, "-o", str(out), "--no-progress"]) == 0
    task = load_task("sample")
    texts = [d.full_text for d in task.corpus]
    doc_ids = [d.doc_id for d in task.corpus]
    corpus = analyzed_corpus(texts)
    dictionary = Dictionary(corpus)
    analyzer = LuceneEnglishAnalyzer()
    for k1, b in ((1.2, 0.75), (0.9, 0.4), (2.0, 0.1)):
        spec = resolve_spec(RunSpec(retriever="bm25-compat", bm25_k1=k1, bm25_b=b))
        folder = out / spec.folder()
        assert json.loads((folder / "spec.json").read_text())["key"] == spec.key()
        run = read_trec_run(folder / "sample.run")
        model = LuceneBM25Model(dictionary=dictionary, k1=k1, b=b)
        index = SparseMatrixSimilarity(model[list(map(dictionary.doc2bow, corpus))], num_docs=len(corpus),
                                       num_terms=len(dictionary), normalize_queries=False, normalize_documents=False)
        for q in task.queries:
            sims = np.asarray(index[model[dictionary.doc2bow(analyzer.analyze(q.text))]], dtype=float)
            positive = {d: s for d, s in run[q.query_id].items() if s > 0}
            assert_ranking(positive, sims, doc_ids, min(100, int((sims > 0).sum())), rtol=1e-4)
    # The defaults are the default run: one folder with no settings in its name.
    assert (out / "none" / "none" / "bm25-compat" / "sample.json").is_file()
    assert len(list(out.rglob("sample.json"))) == 3


def test_k1_and_b_are_checked_and_dropped_where_no_bm25_runs() -> None:
    from r2med_agent.errors import ConfigError

    with pytest.raises(ConfigError, match="--b must be between 0 and 1"):
        resolve_spec(RunSpec(bm25_b=1.5))
    with pytest.raises(ConfigError, match="--k1 must be >= 0"):
        resolve_spec(RunSpec(bm25_k1=-1))
    assert resolve_spec(RunSpec(retriever="minilm", bm25_k1=1.2)) == resolve_spec(RunSpec(retriever="minilm"))
    assert resolve_spec(RunSpec(retriever="bm25+minilm", bm25_k1=1.2)).settings() == {"bm25_k1": 1.2}
