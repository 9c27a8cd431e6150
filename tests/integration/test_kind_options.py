"""A retriever kind declares its own options (issue 36 item 2): a toy kind with one setting, from a
plugin module outside the package, gets its ``run`` option in a fresh process (``--plugin``); a
value other than its default enters the run's key and folder, the default does not, and the
result reads back, with the same key and folder, in a process that lacks the plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from r2med_agent.errors import ConfigError
from r2med_agent.experiment.spec import RunSpec

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
from dataclasses import dataclass, field

from r2med_agent.errors import ConfigError
from r2med_agent.plugins import register
from r2med_agent.retrieval.registry import RetrieverKind, kind_option


@dataclass(frozen=True)
class ShortOptions:
    depth: int = field(default=5, metadata=kind_option("Documents the short retriever returns per query."))

    def __post_init__(self):
        if self.depth < 1:
            raise ConfigError(f"--short-depth must be at least 1, got {self.depth}")


class Short:
    name = "short"

    def __init__(self, task, depth):
        self.ids, self.depth = sorted(doc.doc_id for doc in task.corpus), depth

    def search(self, requests, k):
        return {r.query_id: {d: 1.0 / (i + 1) for i, d in enumerate(self.ids[:min(k, self.depth)])} for r in requests}


register("retrievers", "short", RetrieverKind(
    lambda: ["short"], lambda word, task, options: Short(task, options.own.depth), combine="text",
    options=ShortOptions))
'''


def cli(args: list[str], site: Path | None) -> subprocess.CompletedProcess[str]:
    paths = [str(ROOT)] + ([str(site)] if site else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("R2MED_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "r2med_agent", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "short_kind.py").write_text(PLUGIN, encoding="utf-8")
    return tmp_path / "site"


def test_a_kinds_own_option_is_a_run_option_and_part_of_the_identity(site: Path, tmp_path: Path) -> None:
    shown = cli(["--plugin", "short_kind", "run", "--help"], site)
    assert shown.returncode == 0, shown.stderr
    assert "--short-depth" in shown.stdout and "Documents the short retriever" in shown.stdout
    assert "--short-depth" not in cli(["run", "--help"], None).stdout

    out = tmp_path / "results"
    base = ["--plugin", "short_kind", "run", "--retriever", "short", "--task", "sample", "--no-progress", "-o", str(out)]
    for extra in ([], ["--short-depth", "5"], ["--short-depth", "3"]):
        proc = cli([*base, *extra], site)
        assert proc.returncode == 0, proc.stderr
    folders = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("*/*/*/sample.json"))
    assert len(folders) == 2 and folders[0] == "none/none/short", folders  # the default: no token
    assert folders[1].startswith("none/none/short__short.depth-3__"), folders

    # Read back without the plugin: the same key, folder and label.
    record = json.loads((out / folders[1] / "sample.json").read_text())
    spec = RunSpec.from_record(record["config"])
    assert json.loads(spec.key()) == {"kind_options": {"short": {"depth": 3}}, "retriever": "short"}
    assert spec.folder() == folders[1] and spec.label == "none/none/short [short.depth=3]"
    assert RunSpec.from_key(spec.key()) == spec
    run = (out / folders[1] / "sample.run").read_text().splitlines()
    assert len(run) == 3 * len({line.split()[0] for line in run})  # depth 3: three documents a query

    refused = cli([*base, "--short-depth", "0"], site)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--short-depth must be at least 1, got 0" in refused.stderr


def test_options_of_a_kind_that_declares_none_are_refused() -> None:
    from r2med_agent.experiment.resolve import resolve_spec

    with pytest.raises(ConfigError, match="retriever kind 'dense' declares no options"):
        resolve_spec(RunSpec(retriever="minilm", kind_options={"dense": {"depth": 3}}))
    # BM25's own settings keep their names and identity (bm25_k1, token k1-1.2).
    assert resolve_spec(RunSpec(bm25_k1=1.2)).settings() == {"bm25_k1": 1.2}


def test_the_command_line_of_a_spec_gives_a_kinds_own_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reproduce`` prints and runs a row's command line from its spec: a kind's own setting
    comes back as the option the kind declares, never as a ``--kind-options`` dict."""
    from r2med_agent.experiment.command import cli_args
    from r2med_agent.retrieval.registry import RETRIEVER_KINDS

    namespace: dict[str, object] = {}
    exec(PLUGIN.replace('register("retrievers", "short", RetrieverKind(', 'KIND = (RetrieverKind('), namespace)  # noqa: S102
    monkeypatch.setitem(RETRIEVER_KINDS, "short", namespace["KIND"])
    spec = RunSpec(retriever="short", kind_options={"short": {"depth": 3}})
    assert cli_args(spec) == ["--method", "none", "--retriever", "short", "--short-depth", "3"]
    with pytest.raises(ConfigError, match="declares no option depth here"):
        cli_args(RunSpec(retriever="short", kind_options={"gone": {"depth": 3}}))
