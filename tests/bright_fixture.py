"""A tiny copy of BRIGHT's hub layout (``xlangai/BRIGHT``), written by the tests themselves.

Folders ``examples/``, ``documents/``, ``long_documents/`` and ``gpt4_reason/`` with one
``<task>-00000-of-00001.parquet`` file per task, the columns of the real configurations (the dataset
card's ``dataset_info``): examples ``query``, ``reasoning``, ``id``, ``excluded_ids``,
``gold_ids_long``, ``gold_ids``, ``gold_answer``; documents ``id``, ``content``.

Two tasks:

* ``biology`` (StackExchange-like): short passages ``<page>_<i>.txt`` split from long pages
  ``<page>.txt``; every query excludes ``["N/A"]``; a long-document split with ``gold_ids_long``.
* ``leetcode``: each query's own problem is in the corpus and is excluded, as BRIGHT excludes
  a problem's own solution; BM25 ranks it first because the texts share every word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHARD = "-00000-of-00001.parquet"

BIOLOGY_DOCS = {
    "insects_light/Phototaxis_0.txt": "Phototaxis is movement of an organism toward or away from light.",
    "insects_light/Phototaxis_1.txt": "Moths use the moon as a compass; artificial lights confuse the angle.",
    "insects_light/Phototaxis_2.txt": "Some insects show negative phototaxis and hide from bright light.",
    "nasal_cycle/Nasal_cycle_0.txt": "The nasal cycle alternates congestion between the two nostrils.",
    "nasal_cycle/Nasal_cycle_1.txt": "Erectile tissue in the nose swells on one side every few hours.",
    "sleep/Sleep_0.txt": "Sleep deprivation impairs memory consolidation in the hippocampus.",
    "sleep/Sleep_1.txt": "During deep sleep the brain clears metabolic waste products.",
    "plants/Photosynthesis_0.txt": "Plants convert light energy into chemical energy in chloroplasts.",
}
BIOLOGY_LONG = {
    "insects_light/Phototaxis.txt": " ".join(v for k, v in BIOLOGY_DOCS.items() if k.startswith("insects")),
    "nasal_cycle/Nasal_cycle.txt": " ".join(v for k, v in BIOLOGY_DOCS.items() if k.startswith("nasal")),
    "sleep/Sleep.txt": " ".join(v for k, v in BIOLOGY_DOCS.items() if k.startswith("sleep")),
    "plants/Photosynthesis.txt": BIOLOGY_DOCS["plants/Photosynthesis_0.txt"],
}
BIOLOGY_EXAMPLES = [
    {"id": "0", "query": "Why are insects like moths attracted to bright light at night?",
     "gold_ids": ["insects_light/Phototaxis_0.txt", "insects_light/Phototaxis_1.txt"],
     "gold_ids_long": ["insects_light/Phototaxis.txt"]},
    {"id": "1", "query": "Why can I breathe through only one nostril, and which one alternates?",
     "gold_ids": ["nasal_cycle/Nasal_cycle_0.txt"], "gold_ids_long": ["nasal_cycle/Nasal_cycle.txt"]},
    {"id": "2", "query": "What does the brain do during sleep, and why does memory suffer without it?",
     "gold_ids": ["sleep/Sleep_0.txt", "sleep/Sleep_1.txt"], "gold_ids_long": ["sleep/Sleep.txt"]},
]

LEETCODE_DOCS = {
    "leetcode/two_sum.txt": "Given an array of integers and a target, return indices of two numbers adding to target.",
    "leetcode/three_sum.txt": "Find all unique triplets in the array which give the sum of zero using two pointers.",
    "leetcode/pair_sum_hash.txt": "Use a hash map from value to index to find a complementary pair in one pass.",
    "leetcode/longest_substring.txt": "Find the longest substring without repeating characters with a sliding window.",
    "leetcode/window_max.txt": "Sliding window maximum keeps a deque of candidate indices.",
    "leetcode/binary_search.txt": "Binary search halves a sorted array to find a target value.",
    "leetcode/rotated_search.txt": "Search a rotated sorted array with a modified binary search.",
}
LEETCODE_EXAMPLES = [
    {"id": "two_sum", "query": LEETCODE_DOCS["leetcode/two_sum.txt"],
     "gold_ids": ["leetcode/pair_sum_hash.txt"], "excluded_ids": ["leetcode/two_sum.txt"]},
    {"id": "longest_substring", "query": LEETCODE_DOCS["leetcode/longest_substring.txt"],
     "gold_ids": ["leetcode/window_max.txt"], "excluded_ids": ["leetcode/longest_substring.txt"]},
    {"id": "rotated_search", "query": LEETCODE_DOCS["leetcode/rotated_search.txt"],
     "gold_ids": ["leetcode/binary_search.txt"], "excluded_ids": ["leetcode/rotated_search.txt", "N/A"]},
]
EXCLUDED_FIRST = ("two_sum", "leetcode/two_sum.txt")
"""A query and its excluded document that BM25 ranks first (the same text)."""

GPT4_REASONING = {
    "biology": {
        "0": "Moths navigate by keeping the moon at a fixed angle; phototaxis toward artificial light follows.",
        "1": "The nasal cycle: erectile tissue swells in one nostril, so airflow alternates between them.",
        "2": "During sleep the hippocampus consolidates memory and the brain clears waste; deprivation hurts.",
    },
    "leetcode": {
        "two_sum": "Keep a hash map of values to indices and look up the complementary pair in one pass.",
        "longest_substring": "A sliding window with a deque or set tracks the window without repeats.",
        "rotated_search": "Modified binary search on a rotated sorted array finds the target.",
    },
}


def example_row(base: dict[str, Any], query: str | None = None) -> dict[str, Any]:
    """A full examples row (the real configuration's columns) from the fixture's fields."""
    return {
        "query": base["query"] if query is None else query,
        "reasoning": "",
        "id": base["id"],
        "excluded_ids": list(base.get("excluded_ids", ["N/A"])),
        "gold_ids_long": list(base.get("gold_ids_long", [])),
        "gold_ids": list(base["gold_ids"]),
        "gold_answer": "",
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_bright(root: Path, *, fmt: str = "parquet") -> Path:
    """The fixture in BRIGHT's hub layout under ``root``; returns ``root``."""
    write = write_parquet if fmt == "parquet" else write_jsonl
    name = (lambda split: f"{split}{SHARD}") if fmt == "parquet" else (lambda split: f"{split}.jsonl")
    for split, examples, docs, long_docs in (
        ("biology", BIOLOGY_EXAMPLES, BIOLOGY_DOCS, BIOLOGY_LONG),
        ("leetcode", LEETCODE_EXAMPLES, LEETCODE_DOCS, None),
    ):
        write(root / "examples" / name(split), [example_row(e) for e in examples])
        write(root / "documents" / name(split), [{"id": k, "content": v} for k, v in docs.items()])
        if long_docs is not None:
            write(root / "long_documents" / name(split), [{"id": k, "content": v} for k, v in long_docs.items()])
        reasoning = GPT4_REASONING[split]
        write(root / "gpt4_reason" / name(split), [example_row(e, reasoning[e["id"]]) for e in examples])
    return root


def hub_files(root: Path) -> dict[str, bytes]:
    """Every file of the fixture as the hub serves it: repo path -> bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
