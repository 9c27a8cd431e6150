"""Everyday command-line habits: Ctrl-C, --version, names as users type them, help text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.interrupts import sigint_default


@pytest.mark.parametrize(("trigger", "wait_s"), [("generating", 1.0), ("with llama.cpp", 0.0)],
                         ids=["generating", "loading"])
def test_ctrl_c_prints_the_resume_message_and_exits_130(tmp_path, smollm2_gguf, trigger, wait_s):
    """A real SIGINT sent to a run while it generates, or while llama.cpp loads the model (its
    log callback would swallow the interrupt): one line saying what is kept, no traceback."""
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--method", "hyde",
         "--llm", "smollm2", "--max-tokens", "64", "--no-progress", "-o", str(tmp_path / "out")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
    )
    seen = []
    deadline = time.monotonic() + 300
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if trigger in line:
            break
    assert proc.poll() is None, "".join(seen)
    time.sleep(wait_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "interrupted; finished work is cached and a re-run resumes" in err
    assert "Traceback" not in err and "Aborted" not in err


def _small_task(folder) -> None:  # noqa: ANN001
    """Five short queries over a six-document corpus (R2MED layout): a run that is cheap to resume."""
    import json

    folder.mkdir(parents=True)
    words = ["fever", "cough", "rash", "headache", "nausea", "fatigue"]
    with (folder / "query.jsonl").open("w") as f:
        for i, w in enumerate(words[:5]):
            f.write(json.dumps({"id": f"q{i}", "text": f"What causes {w}?"}) + "\n")
    with (folder / "corpus.jsonl").open("w") as f:
        for i, w in enumerate(words):
            f.write(json.dumps({"id": f"d{i}", "text": f"{w} is a common symptom."}) + "\n")
    with (folder / "qrels.jsonl").open("w") as f:
        for i in range(5):
            f.write(json.dumps({"q_id": f"q{i}", "p_id": f"d{i}", "score": 1}) + "\n")


@pytest.mark.slow
def test_ctrl_c_keeps_every_generation_that_finished(tmp_path, smollm2_gguf):
    """Issue 30 item 3: a real SIGINT to a real llama.cpp run after its second generation; the
    re-run takes those from the cache and generates only the rest, as the interrupt line promises
    (the local backend used to commit in chunks of 4, so the re-run made all 5 again)."""
    import re

    data = tmp_path / "mine"
    _small_task(data)
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    args = [sys.executable, "-m", "r2med_agent", "run", "--data-dir", str(data), "--method", "hyde",
            "--llm", "smollm2", "--max-tokens", "12", "--progress-interval", "0", "-o", str(tmp_path / "out")]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    seen = []
    done = 0
    deadline = time.monotonic() + 300
    assert proc.stderr is not None
    while time.monotonic() < deadline and done < 2:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"generating \(.*\): (\d+)/5 generations", line)
        done = int(m.group(1)) if m else done
    assert done >= 2 and proc.poll() is None, "".join(seen)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + err
    assert "interrupted; finished work is cached and a re-run resumes" in err
    again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    m = re.search(r"generating (\d+) of 5 texts \((\d+) from the cache\)", again.stderr)
    assert m is not None, again.stderr
    new, cached = int(m.group(1)), int(m.group(2))
    assert cached >= done and new + cached == 5
    assert f"LLM generations: {new} new, {cached} from cache" in again.stdout


def _main(*args: str) -> int:
    from r2med_agent.cli import main

    return main(list(args))


def test_version(capsys):
    from r2med_agent import __version__

    assert _main("--version") == 0
    assert capsys.readouterr().out.strip() == f"r2med-agent {__version__}"


def test_llm_without_method_is_an_error_not_a_silent_bm25_run(tmp_path, capsys):
    assert _main("run", "--llm", "smollm2", "--task", "sample", "-o", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--llm smollm2 is only used by a method; add --method" in err
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("typed", ["HyDE", "HYDE", "hyde", " Search_R1 "])
def test_method_names_ignore_case(typed):
    from r2med_agent.api import RunConfig

    cfg = RunConfig(tasks=("sample",), method=typed, llm="smollm2")
    assert cfg.method == ("search-r1" if "R1" in typed else "hyde")
    assert cfg.result_dir().parts[-3] == cfg.method


@pytest.mark.parametrize(
    ("typed", "key"),
    [("ndcg@10", "ndcg_at_10"), ("NDCG@10", "ndcg_at_10"), ("ndcg_cut_10", "ndcg_at_10"),
     ("ndcg_cut.10", "ndcg_at_10"), ("nDCG@10", "ndcg_at_10"), ("ndcg_at_10", "ndcg_at_10"),
     ("recall_100", "recall_at_100"), ("recall.100", "recall_at_100"), ("Recall@100", "recall_at_100"),
     ("P_10", "precision_at_10"), ("P@1", "precision_at_1"), ("map_cut_25", "map_at_25"),
     ("MAP@10", "map_at_10"), ("recip_rank", "mrr"), ("MRR", "mrr"), ("bogus", "bogus")],
)
def test_metric_names_as_users_type_them(typed, key):
    from r2med_agent.evaluation import metric_key

    assert metric_key(typed) == key


def test_compare_accepts_trec_eval_and_beir_metric_names(tmp_path, capsys):
    from tests.result_trees import MIXED, write_result

    write_result(tmp_path, "none", "none", "bm25", "sample", MIXED)
    outputs = []
    for name in ("ndcg_at_10", "ndcg@10", "NDCG@10", "ndcg_cut_10"):
        assert _main("compare", str(tmp_path), "--metric", name, "--format", "csv") == 0
        outputs.append(capsys.readouterr().out)
    assert len(set(outputs)) == 1


def test_evaluation_takes_metric_names_in_any_spelling():
    from r2med_agent.evaluation import evaluate

    run = {"q1": {"d1": 2.0, "d2": 1.0}}
    qrels = {"q1": {"d2": 1}}
    a = evaluate(run, qrels, ("ndcg_at_10", "mrr"))
    b = evaluate(run, qrels, ("ndcg@10", "recip_rank"))
    assert list(a.mean.values()) == list(b.mean.values())


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [(["run", "--task", "Biolgy"], "did you mean 'Biology'?"),
     (["run", "--method", "hydee", "--llm", "smollm2"], "did you mean 'hyde'?"),
     (["run", "--retriever", "bm52"], "did you mean 'bm25'?"),
     (["run", "--method", "hyde", "--llm", "smolm2"], "did you mean 'smollm2'?"),
     (["run", "--reranker", "bge-rernker"], "did you mean 'bge-reranker'?")],
)
def test_did_you_mean_for_misspelt_names(tmp_path, capsys, args, suggestion):
    assert _main(*args, "-o", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert suggestion in err and "Traceback" not in err


def test_rerankers_are_listed_like_llms_and_encoders(tmp_path, capsys):
    """Issue 30 item 7: `r2med-agent rerankers` and `run --reranker list` list the registry (kind,
    model, format), a user config's entries included; the help names every kind and says where
    entries of your own go."""
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app
    from r2med_agent.rerank.kinds import RERANKER_KINDS
    from r2med_agent.rerank.spec import reranker_registry

    config = tmp_path / "mine.yaml"
    config.write_text("rerankers:\n  my-ce: {model: /models/my-cross-encoder}\n")
    assert _main("rerankers", "--config", str(config)) == 0
    listed = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in listed.splitlines()[1:] if line.strip()}
    assert set(lines) == set(reranker_registry()) | {"my-ce"}
    assert lines["my-ce"][1:3] == ["cross-encoder", "/models/my-cross-encoder"]
    assert lines["grouprank-32b"][1:4] == ["groupwise", "LLM", "grouprank-32b"]
    assert lines["reasonrank-7b"][-1] == "reasonrank" and lines["rank1-7b"][-1] == "rank1"
    assert _main("run", "--reranker", "list", "--config", str(config), "-o", str(tmp_path / "out")) == 0
    assert capsys.readouterr().out == listed
    assert not (tmp_path / "out").exists()
    _register()
    raw = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    help_text = " ".join(raw.replace("│", " ").split())
    kinds = list(RERANKER_KINDS)
    assert len(kinds) == 5
    for kind in kinds:
        assert f"{kind}" in help_text, kind
    assert "'rerankers:'" in help_text and "--reranker list" in help_text
    assert "'llms:', 'encoders:', 'rerankers:' (cross-encoders and LLM rerankers) and 'tasks:'" in help_text


def test_flags_have_no_bool_tag_in_help():
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert "--no-cache" in out and "--progress" in out and "<bool>" not in out
    assert "<int>" in out  # options that take a value keep their type


def test_piped_run_prints_no_progress_bars(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "-o", str(tmp_path / "o")],
        env={**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "%|" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr


def test_trace_show_lists_ids_in_natural_order(tmp_path, capsys):
    from r2med_agent.methods.loop import traces_to_jsonl
    from r2med_agent.types import Trace

    traces = [Trace(qid, "search-r1", (), "x", "answer") for qid in ("q10", "q2", "q1", "q9")]
    path = tmp_path / "T.traces.jsonl"
    path.write_text(traces_to_jsonl(traces), encoding="utf-8")
    assert _main("trace", "show", str(path), "--query", "q3") == 2
    assert "ids in the file: q1, q2, q9, q10" in capsys.readouterr().err


def test_cache_stats_counts_queries_and_generations_apart(tmp_path, capsys):
    import json

    from r2med_agent.llm.cache.store import CacheRecord, GenerationCache, Use, build_request
    from r2med_agent.types import Generation

    cache = GenerationCache(tmp_path / "g.sqlite")
    records, uses = [], []
    for sample in (0, 1, 2):  # three generations (samples) for one query, one for another
        req = build_request("m", [{"role": "user", "content": "q1"}], {"temperature": 0.7},
                            sample_index=sample)
        key = f"k{sample}"
        records.append(CacheRecord.from_generation(key, req, Generation(text="t", final="t")))
        uses.append(Use(key, "Biology", "q1", "hyde"))
    req = build_request("m", [{"role": "user", "content": "q2"}], {"temperature": 0.7})
    records.append(CacheRecord.from_generation("k9", req, Generation(text="t", final="t")))
    uses.append(Use("k9", "Biology", "q2", "hyde"))
    cache.put_many(records, uses)
    assert _main("cache", "stats", "--cache-path", str(tmp_path / "g.sqlite"), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["uses"] == [{"model_id": "m", "task": "Biology", "method": "hyde", "queries": 2,
                            "generations": 4}]


def test_after_ctrl_c_a_finalizer_error_prints_no_traceback() -> None:
    """A model stopped by Ctrl-C while it loads is half built; its finalizer then fails as the
    process ends (llama-cpp-python's ``Llama.__del__``). After the interrupt line nothing else is
    printed, exit code 130."""
    script = (
        "import importlib, sys\n"
        "app = importlib.import_module('r2med_agent.cli.app')\n"
        "class HalfBuilt:\n"
        "    def __del__(self):\n"
        "        raise AttributeError('half built')\n"
        "keep = HalfBuilt()\n"
        "code = app._interrupted()\n"
        "del keep\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130
    assert proc.stderr.strip() == "interrupted; finished work is cached and a re-run resumes"



def test_run_help_at_80_columns_cuts_no_option_name():
    """Issue 39 item 18: at 80 columns the last panel of `run --help` (output, cache and
    progress) showed `--progress-inter…`: its type column (`<float range> [x>=0.0]`) and help
    words too long to break left the names no room. Every option name of `run` is shown whole."""
    import re

    import typer
    from typer.testing import CliRunner

    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "80"}).output
    assert max(len(line) for line in out.splitlines()) <= 80
    command = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    names = [n for p in command.params for n in (*p.opts, *p.secondary_opts)]
    assert len(names) > 40
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-]|…)", out), name
    cut = [line for line in out.splitlines() if re.match(r"│\s+-\S*…", line)]
    assert not cut, cut
