"""Real Lucene as a peer: pyserini 1.6.0 (Anserini 1.7.1, Lucene 9.9.1) through its fat jar.

Used by ``benchmarks/lucene_parity.py``, ``benchmarks/bm25.py`` and ``tests/integration/test_lucene_parity.py``.
Nothing here is part of the package: pyserini and a Java 21+ runtime are optional peers, installed
with ``pip install --no-deps pyserini==1.6.0 pyjnius`` and a JDK (found through ``JAVA_HOME``, else
``java`` on ``PATH``).

* :func:`analyzer` is pyserini's default analyzer (``get_lucene_analyzer()``, Anserini's
  ``DefaultEnglishAnalyzer``), what R2MED's reference tokenizes with.
* :func:`build_index` runs Anserini's ``IndexCollection`` (what ``python -m pyserini.index.lucene``
  runs) in a child JVM over a ``JsonCollection`` folder, with the given number of threads.
* :class:`Searcher` is what pyserini's ``LuceneSearcher`` wraps: Anserini's ``SimpleSearcher``,
  BM25 k1=0.9 b=0.4, ``batch_search`` with the given number of threads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path

MIN_JAVA = 21


@cache
def java_home() -> str | None:
    """A Java 21+ home: ``JAVA_HOME`` if it holds one, else the ``java`` on ``PATH``; or None."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    on_path = shutil.which("java")
    if on_path:
        candidates.append(Path(on_path).resolve())
    for java in candidates:
        if not java.is_file():
            continue
        try:
            out = subprocess.run([str(java), "-version"], capture_output=True, text=True,
                                 timeout=60).stderr
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r'version "(\d+)', out)
        if m and int(m.group(1)) >= MIN_JAVA:
            return str(java.parent.parent)
    return None


def unavailable() -> str | None:
    """Why real Lucene cannot run here (None when it can)."""
    try:
        import jnius_config  # noqa: F401  (pyjnius)
        import pyserini  # noqa: F401
    except ImportError:
        return "pyserini is not installed (pip install --no-deps pyserini==1.6.0 pyjnius)"
    if java_home() is None:
        return f"no Java {MIN_JAVA}+ (set JAVA_HOME or put java on PATH)"
    return None


def _jar() -> Path:
    import pyserini

    folder = Path(pyserini.__file__).parent / "resources" / "jars"
    jars = sorted(folder.glob("anserini-*-fatjar.jar"))
    if not jars:
        raise RuntimeError("pyserini's Anserini fat jar is missing")
    return jars[-1]


@cache
def _classes() -> dict:
    """Start the JVM in this process (once) and load the classes used here."""
    os.environ["JAVA_HOME"] = java_home() or ""
    from pyserini.pyclass import autoclass  # starts the JVM with pyserini's class path

    return {
        "analyzer": autoclass("io.anserini.analysis.DefaultEnglishAnalyzer"),
        "utils": autoclass("io.anserini.analysis.AnalyzerUtils"),
        "searcher": autoclass("io.anserini.search.SimpleSearcher"),
        "list": autoclass("java.util.ArrayList"),
        "fsdir": autoclass("org.apache.lucene.store.FSDirectory"),
        "reader": autoclass("org.apache.lucene.index.DirectoryReader"),
        "index_searcher": autoclass("org.apache.lucene.search.IndexSearcher"),
        "bm25": autoclass("org.apache.lucene.search.similarities.BM25Similarity"),
        "bow": autoclass("io.anserini.search.query.BagOfWordsQueryGenerator"),
        "sort": autoclass("org.apache.lucene.search.Sort"),
        "sort_field": autoclass("org.apache.lucene.search.SortField"),
        "sort_type": autoclass("org.apache.lucene.search.SortField$Type"),
        "paths": autoclass("java.nio.file.Paths"),
    }


class Analyzer:
    """pyserini's default Lucene analyzer (``get_lucene_analyzer()``: Porter, English stopwords)."""

    def __init__(self) -> None:
        c = _classes()
        self._analyzer = c["analyzer"].newDefaultInstance()
        self._analyze = c["utils"].analyze

    def analyze(self, text: str) -> list[str]:
        return list(self._analyze(self._analyzer, text).toArray())


def write_collection(folder: Path, doc_ids: Sequence[str], texts: Sequence[str]) -> None:
    """An Anserini ``JsonCollection`` (one JSONL file of ``{"id", "contents"}``)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "docs.jsonl").open("w", encoding="utf-8") as f:
        for i, t in zip(doc_ids, texts):
            f.write(json.dumps({"id": i, "contents": t}, ensure_ascii=False) + "\n")


def peak_rss_mb(pid: int | str = "self") -> float:
    """The peak resident memory of a process (``VmHWM``: its own, not a forking parent's), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def build_index(collection: Path, index: Path, threads: int = 1,
                peak: list[float] | None = None) -> float:
    """Index ``collection`` with Anserini's ``IndexCollection`` in a child JVM; wall seconds.
    ``peak`` (a list) gets the JVM's peak resident memory in MB appended (read while it runs)."""
    java = Path(java_home() or "") / "bin" / "java"
    cmd = [str(java), "--add-modules", "jdk.incubator.vector", "-cp", str(_jar()),
           "io.anserini.index.IndexCollection", "-collection", "JsonCollection",
           "-generator", "DefaultLuceneDocumentGenerator", "-input", str(collection),
           "-index", str(index), "-threads", str(threads)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        high = 0.0
        while proc.poll() is None:
            try:
                high = max(high, peak_rss_mb(proc.pid))
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"Anserini IndexCollection failed:\n{err.read()[-2000:]}")
    if peak is not None:
        peak.append(high)
    return seconds


class Searcher:
    """Anserini's ``SimpleSearcher`` (pyserini's ``LuceneSearcher``) with BM25(k1, b)."""

    def __init__(self, index: Path, k1: float = 0.9, b: float = 0.4) -> None:
        c = _classes()
        self._searcher = c["searcher"](str(index))
        self._searcher.set_bm25(float(k1), float(b))
        self._list = c["list"]

    def batch_search(self, queries: Sequence[str], qids: Sequence[str], k: int,
                     threads: int = 1) -> dict[str, list[tuple[str, float]]]:
        """``{qid: [(doc id, score), ...]}`` in Lucene's order, as pyserini's ``batch_search``."""
        jq, jid = self._list(), self._list()
        for q, i in zip(queries, qids):
            jq.add(q)
            jid.add(i)
        hits = self._searcher.batch_search(jq, jid, int(k), int(threads))
        return {q: [(h.docid, h.score) for h in hits.get(q)] for q in qids}


class ExactSearcher:
    """Lucene's own float32 scores, before Anserini's ``ScoreTiesAdjusterReranker`` rounds them to
    4 decimals: the query ``SimpleSearcher`` builds (``BagOfWordsQueryGenerator`` over the
    ``contents`` field), searched by Lucene's ``IndexSearcher`` with BM25(k1, b) and Anserini's
    sort (score, then document id ascending)."""

    def __init__(self, index: Path, k1: float = 0.9, b: float = 0.4) -> None:
        c = self._c = _classes()
        directory = c["fsdir"].open(c["paths"].get(str(index)))
        from jnius import cast

        reader = cast("org.apache.lucene.index.IndexReader", c["reader"].open(directory))
        self._searcher = c["index_searcher"](reader)
        self._searcher.setSimilarity(c["bm25"](float(k1), float(b)))
        self._stored = self._searcher.storedFields()
        self._analyzer = c["analyzer"].newDefaultInstance()
        self._bow = c["bow"]()
        sf = c["sort_field"]
        self._sort = c["sort"](sf.FIELD_SCORE, sf("id", c["sort_type"].STRING_VAL))

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        q = self._bow.buildQuery("contents", self._analyzer, query)
        top = self._searcher.search(q, int(k), self._sort, True)
        return [(self._stored.document(d.doc).get("id"), d.score) for d in top.scoreDocs]
