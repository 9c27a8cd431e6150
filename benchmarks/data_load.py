"""Task loading speed at the size of R2MED's largest task, beside an unvalidated plain reader.

MedXpertQA-Exam has 61,379 documents (about 720 characters each on average, per the NanoR2MED card)
and 97 queries with about 3 positives each. The benchmark writes a task of that shape in R2MED's
layout (``query.jsonl``, ``corpus.jsonl``, ``qrels.jsonl``; seeded random words) to a temporary folder
and times, best of ``--repeat`` runs:

* ``load_task_dir`` without the task cache: r2med-agent's loader: parsing, every validation of
  ``r2med_agent.data`` (ids, texts, duplicates, qrels against queries and corpus, integer grades)
  and the corpus fingerprint (SHA-256 over every id and text);
* ``load_task_dir`` again with the task cache holding the task: the files are hashed and the
  validated task read back, its corpus not parsed until first used (a re-run); and the same plus
  reading every document (a re-run that needs the texts);
* the plain reader: ``json.loads`` per line into dicts and a qrels dict, no checks and no hash,
  which is what loaders without validation (MTEB's, R2MED's own) do once the files are local;
* ``pandas.read_json(lines=True)`` for the three files, when pandas is installed.

Usage: ``python benchmarks/data_load.py [--docs 61379] [--queries 97] [--repeat 3] [--seed 7]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from r2med_agent.data import load_task_dir


def write_task(folder: Path, n_docs: int, n_queries: int, seed: int) -> int:
    """Write the synthetic task; returns the corpus file size in bytes."""
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 11)))
        for _ in range(30_000)
    ]
    with (folder / "corpus.jsonl").open("w", encoding="utf-8") as f:
        for i in range(n_docs):
            words = rng.choices(vocab, k=rng.randint(40, 170))
            f.write(json.dumps({"id": f"doc-{i}", "text": " ".join(words)}) + "\n")
    with (folder / "query.jsonl").open("w", encoding="utf-8") as f, (folder / "qrels.jsonl").open(
        "w", encoding="utf-8"
    ) as g:
        for q in range(n_queries):
            words = rng.choices(vocab, k=rng.randint(80, 250))
            f.write(json.dumps({"id": str(q), "text": " ".join(words), "answer": "x"}) + "\n")
            for d in rng.sample(range(n_docs), 3):
                g.write(json.dumps({"q_id": str(q), "p_id": f"doc-{d}", "score": 1}) + "\n")
    return (folder / "corpus.jsonl").stat().st_size


def plain_reader(folder: Path) -> int:
    def rows(name: str) -> list[dict]:
        with (folder / name).open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    queries = {r["id"]: r["text"] for r in rows("query.jsonl")}
    corpus = {r["id"]: r["text"] for r in rows("corpus.jsonl")}
    qrels: dict[str, dict[str, int]] = {}
    for r in rows("qrels.jsonl"):
        qrels.setdefault(r["q_id"], {})[r["p_id"]] = int(r["score"])
    return len(queries) + len(corpus) + len(qrels)


def r2med_agent_loader(folder: Path) -> int:
    task = load_task_dir(folder, name="MedXpertQA-Exam", family="exam", domain="medicine",
                         use_task_cache=False)
    return len(task.queries) + len(task.corpus) + len(task.qrels)


def r2med_agent_cached(folder: Path) -> int:
    task = load_task_dir(folder, name="MedXpertQA-Exam", family="exam", domain="medicine")
    if getattr(task.corpus, "loaded", True):
        raise RuntimeError("the task cache was not used")
    return len(task.queries) + len(task.corpus) + len(task.qrels)


def r2med_agent_cached_texts(folder: Path) -> int:
    task = load_task_dir(folder, name="MedXpertQA-Exam", family="exam", domain="medicine")
    return len(task.queries) + sum(1 for _ in task.corpus) + len(task.qrels)


def pandas_reader(folder: Path) -> int:
    import pandas as pd

    frames = [pd.read_json(folder / n, lines=True) for n in ("query.jsonl", "corpus.jsonl", "qrels.jsonl")]
    return sum(len(f) for f in frames)


def best_of(fn: Callable[[Path], int], folder: Path, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(folder)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=61_379)
    parser.add_argument("--queries", type=int, default=97)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "task"
        folder.mkdir()
        os.environ["R2MED_CACHE_DIR"] = str(Path(tmp) / "cache")  # the task cache, private
        size = write_task(folder, args.docs, args.queries, args.seed)
        load_task_dir(folder, name="MedXpertQA-Exam", family="exam", domain="medicine")  # stores it
        print(f"task: {args.docs:,} docs ({size / 1e6:.1f} MB corpus.jsonl), {args.queries} queries")
        contenders: list[tuple[str, Callable[[Path], int]]] = [
            ("r2med-agent load_task_dir (validated + fingerprint)", r2med_agent_loader),
            ("  again, from the task cache (corpus not parsed)", r2med_agent_cached),
            ("  again, from the task cache, every document read", r2med_agent_cached_texts),
            ("plain json.loads reader (no checks, no hash)", plain_reader),
        ]
        try:
            import pandas  # noqa: F401

            contenders.append(("pandas.read_json(lines=True)", pandas_reader))
        except ImportError:
            print("(pandas not installed: its row is skipped)")
        print(f"{'loader':<55} {'best of ' + str(args.repeat):>12}")
        for name, fn in contenders:
            print(f"{name:<55} {best_of(fn, folder, args.repeat):>10.2f} s")


if __name__ == "__main__":
    main()
