"""A run resolved once into its plan (issue 36 item 1): one typed, frozen, picklable object that
the runner reads instead of the registries."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest

from r2med_agent.experiment.plan import RunPlan
from r2med_agent.experiment.resolve import Registries, resolve, resolve_spec
from r2med_agent.experiment.spec import RELEASED_SOURCES, RunSpec
from r2med_agent.api import RunConfig, run_experiment
from r2med_agent.types import Generation

ROOT = Path(__file__).resolve().parents[3]


def _configs(out: Path) -> dict[str, RunConfig]:
    return {
        "plain": RunConfig(tasks=("sample",), retriever="bm25", bm25_k1=1.2, output_dir=out, show_progress=False),
        "llm": RunConfig(tasks=("sample",), method="hyde", llm="smollm2", reranker="smollm2-listwise",
                         sampling={"temperature": 0.3}, output_dir=out, show_progress=False),
        "loop": RunConfig(tasks=("sample",), method="search-o1", llm="smollm2", output_dir=out, show_progress=False),
    }


_MAKE = """
import pickle, sys
from pathlib import Path
from tests.unit.experiment.test_plan import _configs
Path(sys.argv[1]).write_bytes(pickle.dumps(_configs(Path(sys.argv[2]))))
"""

_RUN = """
import json, pickle, sys
from pathlib import Path
from r2med_agent.api import run_experiment
from tests.unit.experiment.test_plan import _configs
shipped = pickle.loads(Path(sys.argv[1]).read_bytes())
fresh = _configs(Path(sys.argv[2]))
same = {k: shipped[k].plan == fresh[k].plan and shipped[k] == fresh[k] for k in fresh}
result = run_experiment(shipped["plain"])
print(json.dumps({"same": same, "ndcg": result.average["ndcg_at_10"], "folder": result.result_dir.name}))
"""


def test_a_plan_pickled_in_one_process_rebuilds_identically_and_runs_in_another(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    shipped = tmp_path / "plans.pickle"
    subprocess.run([sys.executable, "-c", _MAKE, str(shipped), str(tmp_path / "out")], check=True, env=env, cwd=ROOT)
    done = subprocess.run([sys.executable, "-c", _RUN, str(shipped), str(tmp_path / "out")], check=True, env=env,
                          cwd=ROOT, capture_output=True, text=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["same"] == {"plain": True, "llm": True, "loop": True}
    here = run_experiment(_configs(tmp_path / "here")["plain"])
    assert got["folder"] == here.result_dir.name and got["ndcg"] == here.average["ndcg_at_10"]


def test_a_plan_holds_every_entry_kind_and_the_final_sampling(tmp_path: Path) -> None:
    from r2med_agent.llm.registry import get_llm_spec
    from r2med_agent.methods import get_method
    from r2med_agent.rerank.spec import get_reranker_spec

    cfgs = _configs(tmp_path)
    made = cfgs["llm"].plan
    assert isinstance(made, RunPlan) and made.spec == cfgs["llm"].spec()
    assert made.method is get_method("hyde") and made.llm == get_llm_spec("smollm2")
    assert made.reranker == get_reranker_spec("smollm2-listwise") and made.reranker_kind.uses_llm
    assert made.reranker_llm == get_llm_spec(made.reranker.llm)
    assert made.sampling == replace(get_llm_spec("smollm2").sampling_params(), temperature=0.3)
    assert [r.word for r in made.retrievers] == ["bm25"] and made.retrievers[0].settings == ("bm25_k1", "bm25_b")
    assert made.prompt_folders and all(reader for _, reader, _ in made.prompt_folders)
    loop = cfgs["loop"].plan
    assert loop.sampling == loop.method().sampling(loop.llm, {})  # the loop's own, merged once
    assert cfgs["plain"].plan.sampling is None and cfgs["plain"].plan.llm is None
    with pytest.raises(FrozenInstanceError):
        made.sampling = None  # type: ignore[misc]


def test_resolving_looks_each_entry_up_once(monkeypatch) -> None:
    """Each entry by name once per run made (there were 4 LLM lookups: request rules, prompt path,
    sampling defaults, the runner's; and the reranker's again in the runner and its factory)."""
    calls: dict[str, int] = {"llm": 0, "reranker": 0}

    class Counting(Registries):
        def llm(self, name):
            calls["llm"] += 1
            return super().llm(name)

        def reranker(self, name):
            calls["reranker"] += 1
            return super().reranker(name)

    made = resolve(RunSpec(method="hyde", llm="smollm2", reranker="bge-reranker", sampling={"temperature": 0.3}), Counting())
    assert calls == {"llm": 1, "reranker": 1}
    assert made.spec == resolve_spec(made.spec)  # resolving a resolved spec gives it back


def test_a_run_config_builds_its_plan_in_one_call(monkeypatch, tmp_path: Path) -> None:
    import r2med_agent.experiment.run_config as run_config

    made = []
    real = run_config.plan_config
    monkeypatch.setattr(run_config, "plan_config", lambda cfg: made.append(cfg) or real(cfg))
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="smollm2", output_dir=tmp_path)
    assert len(made) == 1 and cfg.plan.spec == cfg.spec()
    assert "plan" not in run_config.RUN_OPTIONS  # not an option: made from them


def test_an_unknown_llm_is_the_registrys_message_when_the_run_starts(tmp_path: Path) -> None:
    from r2med_agent.errors import ConfigError

    cfg = RunConfig(tasks=("sample",), method="hyde", llm="no-such-llm", output_dir=tmp_path, show_progress=False)
    assert cfg.plan.llm is None
    with pytest.raises(ConfigError, match="no-such-llm"):
        run_experiment(cfg)


def test_released_generations_come_from_the_plans_registered_source(tmp_path: Path, monkeypatch) -> None:
    """The runner loads released texts through the source the plan holds (data/sources.py)."""
    from r2med_agent.data import sources

    assert set(sources.GENERATION_SOURCES) == set(RELEASED_SOURCES)
    monkeypatch.setitem(sources.GENERATION_SOURCES, "bright", replace(
        sources.GENERATION_SOURCES["bright"], loader=f"{__name__}:_toy_released", about="toy released texts"))
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="any-reasoner", generations="bright", output_dir=tmp_path,
                    show_progress=False)
    assert cfg.plan.source.about == "toy released texts" and cfg.plan.released is cfg.plan.source
    result = run_experiment(cfg)
    record = json.loads((result.result_dir / "sample.json").read_text())
    assert record["stats"]["released_source"] == "toy:sample"
    assert record["stats"]["released_generations"] == 12


def _toy_released(task, plan, data_dir):
    return [Generation(text=q.text, final=q.text) for q in task.queries], f"toy:{task.name}"


def test_the_protocols_declare_what_the_runner_calls() -> None:
    from r2med_agent.retrieval.base import keeps_order
    from r2med_agent.rerank.base import BatchReranker, built_llm
    from r2med_agent.rerank.spec import get_reranker_spec
    from r2med_agent.retrieval.run_files import CandidateRunRetriever

    for name in ("rerank_tasks", "share_llm", "built_llm"):
        assert name in BatchReranker.__dict__
    from r2med_agent.rerank.llm import LLMReranker

    llm_reranker = LLMReranker(get_reranker_spec("smollm2-listwise"), llm=object())
    assert isinstance(llm_reranker, BatchReranker) and built_llm(llm_reranker) is not None
    assert built_llm(object()) is None
    assert keeps_order(CandidateRunRetriever({}, Path("x"))) and not keeps_order(object())


def test_the_plan_holds_the_encoder_entries_the_dry_run_reads() -> None:
    """``reproduce --dry-run`` (grids/needs.py, first_stage.py, schedule.py) reads encoder entries
    from the plan: every searched word's, and the dense encoder a rebuilt shipped list fuses with."""
    from r2med_agent.retrieval.candidates import DENSE_ENCODER, REBUILT
    from r2med_agent.retrieval.dense.spec import encoder_registry

    made = resolve(RunSpec(retriever="bm25+medcpt"))
    assert made.encoder("medcpt") == encoder_registry()["medcpt"] and made.encoder("bm25") is None
    assert [w for w, _ in made.encoders] == ["medcpt"]
    rebuilt = resolve(RunSpec(retriever=REBUILT[0]))
    assert rebuilt.encoder(DENSE_ENCODER) == encoder_registry()[DENSE_ENCODER]
    assert pickle.loads(pickle.dumps(made)).encoders == made.encoders
