"""A data folder holding the embedded ``sample`` task cut to a few queries, for end-to-end tests
whose checks are about a run's identity, files or engine rather than its scores: the same corpus,
layout and qrels as ``sample``, a fraction of the LLM work. Runs point at it with
``--task sample --data-dir <folder> --allow-count-mismatch``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from r2med_agent.paths import resources_dir


def sample_subset(root: Path, query_ids: Sequence[str] = ("0", "1")) -> Path:
    """Write ``root/sample/`` with ``query_ids`` (their queries and qrels) and the whole corpus;
    return ``root``, the folder to pass as ``--data-dir``."""
    src = resources_dir() / "sample"
    out = root / "sample"
    out.mkdir(parents=True)
    wanted = set(query_ids)
    for name, key in (("query.jsonl", "id"), ("qrels.jsonl", "q_id")):
        lines = src.joinpath(name).read_text(encoding="utf-8").splitlines()
        keep = [line for line in lines if json.loads(line)[key] in wanted]
        assert {json.loads(line)[key] for line in keep} == wanted, f"sample has no query among {sorted(wanted)}"
        out.joinpath(name).write_text("\n".join(keep) + "\n", encoding="utf-8")
    out.joinpath("corpus.jsonl").write_bytes(src.joinpath("corpus.jsonl").read_bytes())
    return root
