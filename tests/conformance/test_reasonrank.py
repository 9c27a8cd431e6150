"""ReasonRank (8421BCD/ReasonRank) against the project's ``format: reasonrank`` listwise reranker,
byte for byte: passages repaired by ftfy and cut to tokens of a real tokenizer
(``utils.convert_doc_to_prompt_content``), the rendered and repaired prompt of every window
(``RankListwiseOSLLM.create_prompt``), the sliding windows and the reading of good, malformed and
empty answers (``sliding_windows_batched``, ``receive_permutation``), and the reading of its
released first-stage run files (``run_rank_llm.py``), ties included.

The authors' listwise ranker runs for real on a bare instance (no model: its ``run_llm_batched``
answers from the same script as the project's scripted LLM); vLLM, pyserini and dacite are
stubbed where its modules import them, and ``toml`` is read with the standard library's tomllib.
"""

from __future__ import annotations

import ast
import collections
import re
import tomllib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from r2med_agent.llm.cache.wrapper import CachedLLM
from r2med_agent.prompts.importer import import_clone, write_prompts
from r2med_agent.rerank import formats
from r2med_agent.rerank.llm import LLMReranker, RerankJob, ranked_requests, read_window
from r2med_agent.rerank.spec import RerankerSpec, get_reranker_spec
from r2med_agent.retrieval.run_files import CandidateRunRetriever, read_ranked_run
from r2med_agent.types import Doc, Query, SearchRequest, Task
from tests.conformance.conftest import load_reference_module, reference_repo, stub
from tests.conformance.rerank_inputs import (
    HOSTILE_DOCS,
    as_run,
    first_stage,
    minilm_tokenizer,
    pick,
    render,
    requests,
    sample_task,
    smol_dir,
    smol_llm_spec,
    smol_tokenizer,
)
from tests.fakes import ScriptedLLM

REPO = "8421BCD/ReasonRank"
MODE = "rank_GPT_reasoning"

# Answers the reading must agree on: a whole block, an unclosed one, none (every number of the
# text counts), repeats / out of range / zero, empty, digits int() refuses (superscripts: the
# window stays), other scripts' digits (int() reads them), upper-case tags, stray numbers.
ANSWERS = [
    lambda n: "<think>the last first</think>\n<answer>" + " > ".join(f"[{i}]" for i in range(n, 0, -1)) + "</answer>",
    lambda n: "<think>long reasoning <answer>[3] > [1]",
    lambda n: "I think [2] > [1] is right, and 3 is poor.",
    lambda n: "<think>x</think><answer>[1] > [1] > [99] > [0]</answer>",
    lambda n: "",
    lambda n: "<think>a</think><answer>[\u00b2] > [1]</answer>",
    lambda n: "<think>a</think><answer>[\u0663] > [\u0661]</answer>",
    lambda n: "<THINK>A</THINK> <ANSWER>[2] > [3]</ANSWER>",
    lambda n: "<think>b</think><answer>[2] > [1], since passage 3 (2019) is off</answer>",
]


def _answer(user: str) -> str:
    n = int(re.search(r"I will provide you with (\d+) passages", user).group(1))
    return ANSWERS[pick(user, len(ANSWERS))](n)


def _user_part(rendered: str) -> str:
    """The user message inside a prompt rendered by SmolLM2's chat template."""
    return rendered.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


@pytest.fixture(scope="module")
def reasonrank():
    folder = reference_repo(REPO)
    toml = stub("toml", load=lambda path: tomllib.loads(Path(path).read_text(encoding="utf-8")))
    stubs = {"vllm": stub("vllm"), "vllm.lora": stub("vllm.lora"), "vllm.lora.request": stub("vllm.lora.request"),
             "pyserini": stub("pyserini"), "pyserini.search": stub("pyserini.search"), "dacite": stub("dacite"),
             "toml": toml}
    listwise = load_reference_module(folder, "rerank/rank_listwise_os_llm.py", stubs=stubs, search=[folder])
    utils = load_reference_module(folder, "utils.py", stubs=stubs, search=[folder])
    data = load_reference_module(folder, "data.py", stubs=stubs, search=[folder])
    run_stubs = {**stubs, "datasets": stub("datasets"), "pandas": stub("pandas"),
                 "pyserini.search.lucene": stub("pyserini.search.lucene"), "pyserini.search._base": stub("pyserini.search._base"),
                 "pyserini.util": stub("pyserini.util")}
    run_rank_llm = load_reference_module(folder, "run_rank_llm.py", stubs=run_stubs, search=[folder])
    info = tomllib.loads((folder / "listwise_prompt_r1.toml").read_text(encoding="utf-8"))
    return SimpleNamespace(folder=folder, listwise=listwise, utils=utils, data=data, info=info, run_rank_llm=run_rank_llm)


@pytest.fixture(scope="module")
def imported(reasonrank, tmp_path_factory):
    out = tmp_path_factory.mktemp("reasonrank-prompts")
    write_prompts(import_clone(reasonrank.folder), out)
    return out


def _authors_ranker(ref, tokenizer, max_length: int, prompts: list[str]):
    """A bare ``RankListwiseOSLLM`` as ``run_rank_llm.py`` sets it up for R2MED, without a model."""
    ranker = ref.listwise.RankListwiseOSLLM.__new__(ref.listwise.RankListwiseOSLLM)
    ranker.args = SimpleNamespace(prompt_mode=MODE)
    ranker.prompt_mode = MODE
    ranker.prompt_info = ref.info
    ranker._tokenizer = tokenizer
    ranker.max_passage_length = max_length

    def run_llm_batched(batch, output_passages_num=None):
        prompts.extend(batch)
        return [(_answer(_user_part(p)), 1) for p in batch]

    ranker.run_llm_batched = run_llm_batched
    return ranker


def _project(task, lists, max_length, window, step, prompts_dir):
    """The shipped ``reasonrank-7b`` entry (its LLM scripted; window, step and, where it is not
    ReasonRank's 512, the passage length as given)."""
    spec = replace(get_reranker_spec("reasonrank-7b"), llm="x", window=window, step=step)
    if max_length != 512:
        spec = replace(spec, max_doc_tokens=max_length)
    fake = ScriptedLLM(lambda messages, params: _answer(messages[-1]["content"]), model_id=str(smol_dir()))
    reranker = LLMReranker(spec, llm=CachedLLM(fake, smol_llm_spec()), prompts_dir=prompts_dir)
    job = RerankJob(task, requests(task), as_run(lists), {d.doc_id: d.full_text for d in task.corpus})
    out = reranker.rerank_tasks([job], max(len(v) for v in lists.values()))[0]
    return out, [m for call in fake.calls for m in call]


@pytest.mark.parametrize("max_length,window,step,depth,own", [
    (512, 4, 2, 12, False), (512, 20, 10, 20, False), (512, 4, 2, 12, True), (24, 4, 2, 12, False), (40, 5, 3, 13, False)])
def test_reasonrank_prompts_windows_and_reading_match_the_authors(reasonrank, imported, max_length, window, step,
                                                                  depth, own) -> None:
    """``own``: the project's shipped template (its verbatim copy) instead of the imported one."""
    tok = smol_tokenizer()
    task = sample_task()
    lists = first_stage(task, depth)
    texts = {d.doc_id: d.full_text for d in task.corpus}
    data = reasonrank.data
    theirs_prompts: list[str] = []
    ranker = _authors_ranker(reasonrank, tok, max_length, theirs_prompts)
    batch = [data.Request(query=data.Query(qid=q.query_id, text=q.text),
                          candidates=[data.Candidate(docid=d, score=float(depth - i), doc={"contents": texts[d]})
                                      for i, d in enumerate(lists[q.query_id])]) for q in task.queries]
    results, _, _ = ranker.sliding_windows_batched(batch, rank_start=0, rank_end=depth, window_size=window, step=step)

    out, sent = _project(task, lists, max_length, window, step, None if own else imported)
    assert [render(tok, m) for m in sent] == theirs_prompts
    for q, result in zip(task.queries, results):
        run = out.run[q.query_id]
        assert list(run) == [c.docid for c in result.candidates], q.query_id
    assert out.stats["passage_cut"].startswith("tokenizer of")
    # The run as ReasonRank writes and evaluates it: each rank's first-stage score, six decimals.
    assert out.run == _authors_written_run(reasonrank, results, tmp_path_of(imported))


def tmp_path_of(imported: Path) -> Path:
    return imported.parent


def _authors_written_run(ref, results, tmp: Path) -> dict[str, dict[str, float]]:
    """ReasonRank's ``write_run`` (its TREC writer) and the reading of that file by its
    ``trec_eval.Eval`` (each line's document and score; a later line of the same document wins)."""
    path = tmp / "reasonrank.run"
    writer = ref.utils.get_output_writer(str(path), ref.utils.OutputFormat("trec"), "w", max_hits=1000, tag="t", topics={})
    ref.run_rank_llm.write_run(writer, results, SimpleNamespace(remove_duplicates=False, remove_query=False))
    runs: dict[str, dict[str, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        parts = line.split(" ")
        runs.setdefault(parts[0], {})[parts[2]] = float(parts[4])
    return runs


@pytest.mark.parametrize("tokenizer", ["smol", "minilm"])
@pytest.mark.parametrize("max_length", [1, 7, 512])
def test_reasonrank_passage_cut_and_repair(reasonrank, tokenizer, max_length) -> None:
    """``convert_doc_to_prompt_content`` (strip, ftfy, tokens back to text, bracketed numbers
    rewritten) against the project's, with SmolLM2's byte-level tokenizer and MiniLM's lossy
    WordPiece one, over every hostile document."""
    tok = smol_tokenizer() if tokenizer == "smol" else minilm_tokenizer()
    from r2med_agent.config import build
    from r2med_agent.llm.registry import LLMSpec

    folder = str(smol_dir()) if tokenizer == "smol" else tok.name_or_path
    spec = build(LLMSpec, {"name": "t", "backend": "vllm", "model": folder}, "test")
    reranker = LLMReranker(RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="t",
                                        max_doc_tokens=max_length, fix_text=True),
                           llm=CachedLLM(ScriptedLLM(lambda m, p: "", model_id=folder), spec))
    for doc_id, text in {**HOSTILE_DOCS, "sample": sample_task().corpus[0].text}.items():
        theirs = reasonrank.utils.convert_doc_to_prompt_content(tok, {"contents": text}, max_length, truncate_by_word=False)
        assert formats.replace_numbers(reranker.prepared(text)) == theirs, doc_id


def test_reasonrank_reads_answers_as_the_authors(reasonrank) -> None:
    """``receive_permutation`` over single windows: the project's strict reading gives the same order."""
    ranker = _authors_ranker(reasonrank, None, 1, [])
    data = reasonrank.data
    answers = [f(5) for f in ANSWERS] + ["[5]>[4]>[3]>[2]>[1]", "<answer></answer>", "<think></think><answer>4 3",
                                          "<think>a</think>\n\n<answer>\n[2]\n</answer>", "1 2 3 4 5 6 7", "\u00bd [2]"]
    for text in answers:
        result = data.Result(query=data.Query(qid="q", text="t"),
                             candidates=[data.Candidate(docid=f"d{i}", score=0.0, doc={}) for i in range(5)])
        expected = [c.docid for c in ranker.receive_permutation(result, text, 0, 5).candidates]
        spec = RerankerSpec(name="rr", kind="listwise", format="reasonrank", llm="x", window=5, step=1)
        order, _, _ = read_window(_gen(text), 5, spec.format, spec.parse == "strict")
        assert [f"d{i}" for i in order] == expected, text


def _gen(text: str):
    from r2med_agent.types import Generation

    return Generation(text=text, final=text)


# --------------------------------------------------------------------------- released run files


def _authors_read_run(ref, path: Path, depth: int) -> dict[str, list[str]]:
    """``run_rank_llm.py``'s reading of a first-stage run file (its code, taken from the file and
    run here on the file): each query's candidates in the file's order, the first ``depth``."""
    tree = ast.parse((ref.folder / "run_rank_llm.py").read_text(encoding="utf-8"))
    block = next(n for n in ast.walk(tree) if isinstance(n, ast.If)
                 and ast.unparse(n.test) == "os.path.exists(first_state_run_path)")
    namespace = {"first_state_run_path": str(path), "topics": collections.defaultdict(str),
                 "id2doc": collections.defaultdict(str), "args": SimpleNamespace(retrieval_num=depth),
                 "dataset": "r2med_X", "BRIGHT_DATASETS": [], "r2med_DATASETS": ["r2med_X"], "json": __import__("json"),
                 "Query": ref.data.Query, "Request": ref.data.Request, "Candidate": ref.data.Candidate,
                 "print": lambda *a, **k: None}
    exec(compile(ast.Module(body=block.body, type_ignores=[]), "run_rank_llm.py", "exec"), namespace)  # noqa: S102
    return {r.query.qid: [c.docid for c in r.candidates] for r in namespace["results"]}


def _project_read_run(path: Path, depth: int) -> dict[str, list[str]]:
    """The project's reading, as a reranker receives it: ``run --candidates`` (the file's order,
    ties included) through the reranker's first-stage lists."""
    run = read_ranked_run(path)
    retriever = CandidateRunRetriever(run, path)
    task = Task("X", "qa", "biology", tuple(Query(q, "") for q in run), tuple(Doc(d, "") for docs in run.values()
                for d in docs), {}, "t", "X")
    reqs = [SearchRequest(q, "") for q in run]
    job = RerankJob(task, reqs, retriever.search(reqs, depth), {d.doc_id: "" for d in task.corpus},
                    ordered=retriever.keeps_order)
    return {req.query_id: items[:depth] for _, _, req, items in ranked_requests([job], depth)}


def test_released_runs_are_read_as_the_authors_read_them(reasonrank) -> None:
    """The 8 released E5-mistral runs (876 queries; 103 of them have tied scores that a sort by
    score and document id would reorder). They list 337 documents a second time for the same
    query (Bioinformatics 18, Medical-Sciences 17, MedQA-Diag 79, PMC-Treatment 223 lines):
    ReasonRank reads both listings, a run holds a document once, so the project keeps the first
    (a kept difference, docs/protocol.md); apart from those lines the lists are the same."""
    files = sorted((reasonrank.folder / "runs").glob("r2med_*/*.txt"))
    assert len(files) == 8
    reordered = repeats = 0
    for path in files:
        theirs = _authors_read_run(reasonrank, path, 100)
        firsts = {q: list(dict.fromkeys(docs)) for q, docs in theirs.items()}
        repeats += sum(len(docs) - len(firsts[q]) for q, docs in theirs.items())
        assert _project_read_run(path, 100) == firsts, path.parent.name
        run = read_ranked_run(path)
        reordered += sum(1 for q, docs in run.items() if sorted(docs, key=lambda d: (-docs[d], d)) != firsts[q])
    assert (reordered, repeats) == (103, 337)


def test_hostile_run_file_is_read_as_the_authors_read_it(reasonrank, tmp_path) -> None:
    lines = []
    for q in ("q1", "q/2", "\u00fc"):
        for rank, doc in enumerate(["z", "a", "odd/\u00e9:1", "[3]", "m", "0"], start=1):
            lines.append(f"{q} Q0 {doc} {rank} {1.0 if rank < 5 else -0.5} tag")
    path = tmp_path / "hostile.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for depth in (3, 6, 100):
        assert _project_read_run(path, depth) == _authors_read_run(reasonrank, path, depth)
