"""A separate process for the concurrency and fault tests (tests/integration/test_concurrency.py):
``python -m tests.concurrency_worker <what> <folder> [options]``.

- ``dense FOLDER N_DOCS SHARD DELAY``: encode a corpus of ``N_DOCS`` documents into the embedding
  cache under FOLDER (shards of SHARD documents, each taking DELAY seconds: long enough for
  several processes to overlap), print the sha256 of the matrix.
- ``bm25 FOLDER N_DOCS``: build and save the BM25 index of such a corpus under FOLDER.
- ``results FOLDER ROUNDS``: write the result set of task ``T`` ROUNDS times, round ``i`` with
  every file holding ``i`` (a kill test stops it anywhere).

The encoder is a deterministic hash of the text (the processes race on the cache, not on a model).
An R2MedError prints ``error: <message>`` and exits with its code, as the CLI does.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import numpy as np

from r2med_agent.errors import R2MedError
from r2med_agent.types import Doc, Query, Task


class SlowHashEncoder:
    """Vectors from a hash of the text; each call sleeps ``delay`` seconds first."""

    def __init__(self, delay: float, dim: int = 16) -> None:
        from r2med_agent.retrieval.dense.spec import get_encoder_spec

        self.spec = get_encoder_spec("minilm")
        self.name = self.spec.name
        self.delay, self.dim = delay, dim

    def encode(self, texts, *, side, prefix="", titles=None):
        time.sleep(self.delay)
        rows = []
        for t in texts:
            seed = int.from_bytes(hashlib.sha256((prefix + t).encode()).digest()[:8], "little")
            rows.append(np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32))
        return np.stack(rows)


def corpus(n_docs: int) -> list[Doc]:
    return [Doc(f"d{i}", f"document {i} about topic {i % 7} and word{i % 13}") for i in range(n_docs)]


def _dense(folder: Path, n_docs: int, shard: int, delay: float) -> None:
    from r2med_agent.retrieval.dense.cache import encode_corpus

    arr = encode_corpus(SlowHashEncoder(delay), corpus(n_docs), fingerprint=f"c{n_docs}",
                        shard_size=shard, root=folder)
    print(hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest())


def _bm25(folder: Path, n_docs: int) -> None:
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever

    docs = tuple(corpus(n_docs))
    task = Task("conc", "qa", "biology", (Query("q", "topic 3"),), docs, {"q": {"d3": 1}},
                "test", f"c{n_docs}")
    BM25Retriever.for_task(task, index_root=folder, show_progress=False)
    print("saved")


def _write_one_by_one(folder: Path, task: str, files: dict[str, str]) -> None:
    """How the runner wrote a task's files before result sets (each file atomic, the set not)."""
    from r2med_agent.io import atomic_write_text

    for suffix, text in files.items():
        atomic_write_text(folder / f"{task}{suffix}", text)


def _results(folder: Path, rounds: int) -> None:
    try:
        from r2med_agent.experiment.store import write_task_set
    except ImportError:  # the code before result sets: to show what a kill did there
        write_task_set = _write_one_by_one

    for i in range(rounds):
        files = {".run": f"q Q0 d{i} 1 1.0 round{i}\n" * 2000}
        if i % 2 == 0:  # a set with a file the next one lacks
            files[".generations.jsonl"] = f'{{"round": {i}}}\n' * 2000
        files[".json"] = f'{{"dataset_name": "T", "round": {i}, "test": {{"ndcg_cut_10": {i}}}}}\n'
        write_task_set(folder, "T", files)
        print(i, flush=True)


def main(argv: list[str]) -> int:
    what, folder, *rest = argv
    try:
        if what == "dense":
            _dense(Path(folder), int(rest[0]), int(rest[1]), float(rest[2]))
        elif what == "bm25":
            _bm25(Path(folder), int(rest[0]))
        elif what == "results":
            _results(Path(folder), int(rest[0]))
        else:
            raise SystemExit(f"unknown worker {what}")
    except R2MedError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
