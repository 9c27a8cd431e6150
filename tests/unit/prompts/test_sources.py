"""The authors' prompts at pinned commits (r2med_agent.prompts.sources): fetched once over a real
loopback HTTP server or from a ``file://`` mirror into the cache, checked against their pinned
hashes, imported, reused; a clone at the pinned commit in their place; and the three ways it
goes wrong (no network and no clone, a mirror or clone at another commit, a changed file), each
one line, before any work, with nothing written.

The sources here are this test's own: fake clones of R2MED and Search-R1 in the references'
layouts (tests/unit/prompts/test_import.py), pinned at their git commits with their files'
hashes, in place of configs/pinned/prompt_sources.yaml. The real pins are checked against the authors'
files in tests/conformance/test_prompt_sources_pins.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from r2med_agent.prompts import sources as ps
from r2med_agent.prompts import templates as prompts
from r2med_agent.cli.app import main
from r2med_agent.errors import ConfigError, PromptSourceError
from r2med_agent.experiment.command import cli_args
from r2med_agent.experiment.resolve import resolve, resolve_spec
from r2med_agent.experiment.spec import RunSpec
from r2med_agent.types import Query
from tests.prompt_mirror import LoopbackMirror, closed_port_url, mirror_files
from tests.unit.prompts.test_import import HYDE, git_commit, r2med_clone, search_r1_clone, task


def _pin(name: str, repo: str, reader: str, clone: Path, folders: tuple[str, ...], files: tuple[str, ...]) -> ps.PromptSource:
    hashes = {rel: hashlib.sha256((clone / rel).read_bytes()).hexdigest() for rel in files}
    return ps.PromptSource(name, repo, git_commit(clone), reader, folders, hashes, "a test's own")


@pytest.fixture
def sources(tmp_path, monkeypatch) -> dict[str, tuple[ps.PromptSource, Path]]:
    """Two pinned sources over fake clones, the cache in tmp_path, no $R2MED_PROMPTS_DIR."""
    clones = tmp_path / "clones"
    r2med = r2med_clone(clones)
    r1 = search_r1_clone(clones)
    pinned = {
        "R2MED": (_pin("R2MED", "R2MED/R2MED", "R2MED", r2med, ("hyde", "query2doc", "lamer"),
                       ("src/instrcution.py", "src/example.py")), r2med),
        "Search-R1": (_pin("Search-R1", "PeterGriffinJin/Search-R1", "Search-R1", r1, ("search-r1",),
                           ("scripts/data_process/nq_search.py", "search_r1/llm_agent/generation.py")), r1),
    }
    monkeypatch.setattr(ps, "prompt_sources", lambda: {k: s for k, (s, _) in pinned.items()})
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(prompts.ENV_VAR, raising=False)
    monkeypatch.delenv(ps.BASE_URL_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return pinned


def _hyde_text(templates: Path, query: str) -> str:
    from r2med_agent.methods.expansion import HyDE

    t = task("Biology", "qa", "biology", (Query("q", query),))
    return HyDE(prompts_dir=templates).build_prompts(t)[0][0]["content"]


def test_fetched_once_over_loopback_http_checked_imported_and_reused(sources, tmp_path, monkeypatch) -> None:
    source, clone = sources["R2MED"]
    root = mirror_files(tmp_path / "mirror", source, clone)
    with LoopbackMirror(root) as server:
        monkeypatch.setenv(ps.BASE_URL_ENV, server.url)
        assert not ps.at_hand(source)
        templates = ps.ensure(source)
        assert sorted(server.paths) == sorted(f"/R2MED/R2MED/{source.commit}/{rel}" for rel in source.files)
        assert ps.at_hand(source)
        # R2MED's own text, byte for byte (its trailing space kept), for the task's own key.
        assert _hyde_text(templates, "Why {x}?") == HYDE["Stack-Biology"].format(TEXT="Why {x}?")
        record = json.loads((templates / ".r2med-import.json").read_text())
        assert record["imports"][0]["reference"] == "R2MED/R2MED" and record["imports"][0]["commit"] == source.commit
        assert ps.ensure(source) == templates and len(server.paths) == 2  # the cache: no second request


def test_a_file_mirror_works_the_same(sources, tmp_path, monkeypatch) -> None:
    source, clone = sources["Search-R1"]
    root = mirror_files(tmp_path / "mirror", source, clone)
    monkeypatch.setenv(ps.BASE_URL_ENV, root.as_uri())
    templates = ps.ensure(source)
    assert (templates / "search-r1" / "invalid.j2").is_file()
    assert ps.describe(resolve(RunSpec(method="search-r1", llm="qwen-7b-ins", prompts_from="authors"))) == (
        f"the authors', PeterGriffinJin/Search-R1@{source.commit[:12]} (scripts/data_process/nq_search.py, "
        "search_r1/llm_agent/generation.py): at hand")


def test_a_changed_file_is_refused_and_nothing_is_written(sources, tmp_path, monkeypatch) -> None:
    source, clone = sources["R2MED"]
    root = mirror_files(tmp_path / "mirror", source, clone)
    bad = root / source.repo / source.commit / "src/example.py"  # the second file: the first is fine
    bad.write_text(bad.read_text() + "# changed\n")
    with LoopbackMirror(root) as server:
        monkeypatch.setenv(ps.BASE_URL_ENV, server.url)
        with pytest.raises(PromptSourceError) as err:
            ps.ensure(source)
    message = str(err.value)
    assert "src/example.py" in message and source.files["src/example.py"] in message
    assert hashlib.sha256(bad.read_bytes()).hexdigest() in message and "nothing was written" in message
    assert not (source.folder / "files").exists()  # not even the good file


def test_a_mirror_at_another_commit_is_refused(sources, tmp_path, monkeypatch) -> None:
    source, clone = sources["R2MED"]
    root = mirror_files(tmp_path / "mirror", source, clone, commit="0" * 40)
    with LoopbackMirror(root) as server:  # 404 for the pinned commit's paths
        monkeypatch.setenv(ps.BASE_URL_ENV, server.url)
        with pytest.raises(PromptSourceError, match=f"HTTP 404.*no such file at commit {source.commit}"):
            ps.ensure(source)
        assert len(server.paths) == 1  # a missing file is not retried
    monkeypatch.setenv(ps.BASE_URL_ENV, root.as_uri())
    with pytest.raises(PromptSourceError, match=f"no such file at commit {source.commit}"):
        ps.ensure(source)
    # A server that serves another commit's files under the pinned commit's paths: the hash.
    served = tmp_path / "served"
    mirror_files(served, source, clone)
    (served / source.repo / source.commit / "src/instrcution.py").write_text("hyde = {}\n")
    monkeypatch.setenv(ps.BASE_URL_ENV, served.as_uri())
    with pytest.raises(PromptSourceError, match="not the authors' file at the pinned commit"):
        ps.ensure(source)
    assert not (source.folder / "files").exists()


def test_no_network_and_no_clone_stops_before_any_work(sources, tmp_path, monkeypatch, capsys) -> None:
    """One line naming `r2med-agent prompts import <clone>`, the repository and the commit; exit
    code 7; no task loaded, no LLM built, no result folder made; what was there is untouched."""
    import r2med_agent.data
    import r2med_agent.llm

    source, _ = sources["Search-R1"]
    monkeypatch.setenv(ps.BASE_URL_ENV, closed_port_url())
    monkeypatch.setattr(ps, "FETCH_BACKOFF_S", 0.01)

    def no_work(*a, **k):
        raise AssertionError("work started before the prompts were had")

    monkeypatch.setattr(r2med_agent.data, "load_task", no_work)
    monkeypatch.setattr(r2med_agent.llm, "make_llm", no_work)
    earlier = tmp_path / "results" / "hyde" / "smollm2" / "bm25" / "sample.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"kept": true}\n')
    code = main(["run", "--method", "search-r1", "--llm", "qwen-7b-ins", "--task", "sample",
                 "--output-dir", str(tmp_path / "results"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 7 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    line = lines[0]
    assert "r2med-agent prompts import Search-R1" in line and "PeterGriffinJin/Search-R1" in line
    assert source.commit in line and "Connection refused" in line and "--prompts own" in line
    assert sorted(p.relative_to(tmp_path / "results").as_posix() for p in (tmp_path / "results").rglob("*")) == [
        "hyde", "hyde/smollm2", "hyde/smollm2/bm25", "hyde/smollm2/bm25/sample.json"]
    assert earlier.read_text() == '{"kept": true}\n'
    assert not (source.folder / "files").exists()


def test_a_clone_at_the_pinned_commit_stands_in_for_the_network(sources, tmp_path, monkeypatch, capsys) -> None:
    source, clone = sources["R2MED"]
    monkeypatch.setenv(ps.BASE_URL_ENV, closed_port_url())
    assert main(["prompts", "import", str(clone)]) == 0
    assert f"R2MED/R2MED@{source.commit[:12]}: hyde, query2doc, lamer at hand" in capsys.readouterr().out
    assert ps.at_hand(source)
    assert _hyde_text(ps.ensure(source), "Q") == HYDE["Stack-Biology"].format(TEXT="Q")  # no network needed


def test_a_clone_at_another_commit_or_with_a_changed_file_is_refused(sources, tmp_path, capsys) -> None:
    source, clone = sources["R2MED"]
    (clone / "README.md").write_text("a later commit\n")
    subprocess.run(["git", "-C", str(clone), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "later"],
                   check=True)
    assert main(["prompts", "import", str(clone)]) == 7
    err = capsys.readouterr().err
    assert f"but the prompts are pinned at {source.commit}: git -C {clone} checkout {source.commit}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    copy = tmp_path / "copy"  # no .git: the files decide
    for rel in source.files:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((clone / rel).read_bytes())
    (copy / "src/example.py").write_text((copy / "src/example.py").read_text() + "# edited\n")
    assert main(["prompts", "import", str(copy)]) == 7
    assert "(another commit, or a changed file); nothing was written" in capsys.readouterr().err
    assert not (source.folder / "files").exists()
    (copy / "src/example.py").write_bytes((clone / "src/example.py").read_bytes())
    assert main(["prompts", "import", str(copy)]) == 0 and ps.at_hand(source)


def test_which_runs_render_the_authors_prompts(sources) -> None:
    r2med = sources["R2MED"][0].short
    # The paper's LLMs take the authors' prompts; the local smoke model its own (offline).
    assert resolve_spec(RunSpec(method="hyde", llm="qwen-7b", prompts_from=None)).prompts_from == r2med
    assert resolve_spec(RunSpec(method="hyde", llm="smollm2", prompts_from=None)).prompts_from == "own"
    assert resolve_spec(RunSpec(method="hyde", llm="smollm2", prompts_from="authors")).prompts_from == r2med
    assert resolve_spec(RunSpec(method="hyde", llm="qwen-7b", prompts_from="own")).prompts_from == "own"
    # Released generations render nothing; a folder without a source is the project's wording.
    assert resolve_spec(RunSpec(method="hyde", llm="qwen-7b", generations="r2med", prompts_from=None)).prompts_from == "own"
    assert resolve_spec(RunSpec(reranker="qwen3-32b-listwise", prompts_from="authors")).prompts_from == "own"
    with pytest.raises(ConfigError, match="--prompts must be one of authors, own, got 'theirs'"):
        resolve_spec(RunSpec(method="hyde", llm="qwen-7b", prompts_from="theirs"))


def test_the_two_wordings_are_two_runs_with_their_own_folders_labels_and_commands(sources) -> None:
    from r2med_agent.api import RunConfig

    commit = sources["R2MED"][0].commit
    authors = resolve_spec(RunSpec(method="hyde", llm="qwen-7b", prompts_from=None))
    own = resolve_spec(RunSpec(method="hyde", llm="qwen-7b", prompts_from="own"))
    assert authors.folder() == f"hyde/qwen-7b/bm25__authors-R2MED@{commit[:8]}__{authors.digest()}"
    assert own.folder() == "hyde/qwen-7b/bm25"  # the wording every earlier result was made with
    assert authors.label == f"hyde/qwen-7b/bm25 [prompts_from=R2MED/R2MED@{commit[:12]}]" and own.label == "hyde/qwen-7b/bm25"
    assert "--prompts" not in cli_args(authors) and cli_args(own)[-2:] == ["--prompts", "own"]
    # A record of an earlier version (no prompts_from) was made with the project's wording.
    old = {k: v for k, v in own.record().items() if k != "prompts_from"}
    assert RunSpec.from_record(old) == own
    # A record made at other commits names results this version does not make.
    other = "R2MED/R2MED@" + "1" * 12
    spec = resolve_spec(RunSpec(method="hyde", llm="qwen-7b", prompts_from=other))
    assert spec.prompts_from == other
    with pytest.raises(ConfigError, match="at other commits"):
        cli_args(spec)
    with pytest.raises(ConfigError, match=f"names results made with the authors' prompts at other commits"):
        RunConfig(tasks=("sample",), method="hyde", llm="qwen-7b", prompts_from=other)


def test_the_record_names_the_pinned_files(sources) -> None:
    from r2med_agent.experiment.runner import RunConfig, _config_record

    source = sources["Search-R1"][0]
    cfg = RunConfig(tasks=("sample",), method="search-r1", llm="qwen-7b-ins", prompts_from=None)
    assert cfg.prompts is None
    assert _config_record(cfg)["prompts_import"] == [{
        "reference": "PeterGriffinJin/Search-R1", "commit": source.commit, "folders": ["search-r1"], "pinned": True,
        "files": dict(source.files)}]
    own = RunConfig(tasks=("sample",), method="search-r1", llm="qwen-7b-ins", prompts_from="own")
    assert _config_record(own)["prompts_import"] == []
    # Python's default wording is the CLI's: a RunConfig without prompts_from is `run` without --prompts.
    assert RunConfig(tasks=("sample",), method="search-r1", llm="qwen-7b-ins") == cfg


def test_a_task_the_authors_have_no_prompt_for_stops_before_the_llm(sources, tmp_path, monkeypatch) -> None:
    from r2med_agent.api import RunConfig, run_experiment

    source, clone = sources["R2MED"]
    monkeypatch.setenv(ps.BASE_URL_ENV, mirror_files(tmp_path / "mirror", source, clone).as_uri())
    import r2med_agent.llm

    monkeypatch.setattr(r2med_agent.llm, "make_llm", lambda *a, **k: pytest.fail("the LLM was built"))
    cfg = RunConfig(tasks=("sample",), method="hyde", llm="qwen-7b", prompts_from=None, output_dir=tmp_path / "r",
                    show_progress=False)
    with pytest.raises(ConfigError, match="task sample: the authors' prompts of R2MED/R2MED@.* have no hyde prompt "
                                          "for it .*--prompts own"):
        run_experiment(cfg)
    assert not (tmp_path / "r").exists()


def test_cache_import_stores_released_texts_under_the_authors_prompts(sources, tmp_path, monkeypatch, capsys) -> None:
    """`cache import` keys each text by the request the matching `run` sends: with the paper's
    LLMs that is the authors' prompt, so a later default run finds them and builds no LLM."""
    import json as json_

    from r2med_agent.data import load_task
    from r2med_agent.llm import default_sampling, get_llm_spec, make_llm
    from r2med_agent.methods.expansion import HyDE
    from tests.unit.llm.cache.test_cache import R2MED_ROWS, write_task_dir

    source, clone = sources["R2MED"]
    monkeypatch.setenv(ps.BASE_URL_ENV, mirror_files(tmp_path / "mirror", source, clone).as_uri())
    data = write_task_dir(tmp_path / "data")
    rows = tmp_path / "query_with_hydoc.jsonl"
    rows.write_text("".join(json_.dumps(r) + "\n" for r in R2MED_ROWS))
    db = tmp_path / "g.sqlite"
    assert main(["cache", "import", str(rows), "--task", "Biology", "--method", "hyde", "--llm", "qwen-7b",
                 "--data-dir", str(data), "--allow-count-mismatch", "--cache-path", str(db)]) == 0
    assert "imported 2 generations" in capsys.readouterr().out
    task_ = load_task("Biology", data, allow_count_mismatch=True)
    authors = HyDE(prompts_dir=ps.ensure(source))
    llm = make_llm("qwen-7b", cache_path=db)
    gens = llm.generate(authors.build_prompts(task_), default_sampling(get_llm_spec("qwen-7b")),
                        template_hash=authors.template_hash(task_))
    assert [g.text for g in gens] == [r["hy_doc"] for r in R2MED_ROWS] and all(g.cached for g in gens)
    assert not llm.backend.built


def test_dry_runs_name_every_rows_prompt_source(tmp_path, monkeypatch) -> None:
    """`reproduce --dry-run` of the frontier and the paper's grids: every row says whose prompts
    it renders (the authors' at repo@commit, with whether they are at hand), the zero-shot
    groupwise rows GroupRank's, as their published rows did; a row without a prompt says none."""
    from r2med_agent.api import ReproduceOptions, format_plan, load_grid, plan

    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(prompts.ENV_VAR, raising=False)
    pins = {s.repo: s.short for s in ps.prompt_sources().values()}
    by_reranker = {"grouprank-32b": "AQ-MedAI/Diver", "qwen3-32b-groupwise": "AQ-MedAI/Diver",
                   "qwen3-32b-groupwise-think": "AQ-MedAI/Diver", "qwen-32b-groupwise": "AQ-MedAI/Diver",
                   "deepseek-v3.1-groupwise": "AQ-MedAI/Diver", "reasonrank-32b": "8421BCD/ReasonRank",
                   "reasonrank-7b": "8421BCD/ReasonRank", "rank1-32b": "orionw/rank1", "rank1-7b": "orionw/rank1",
                   "rank-r1-14b": "ielab/llm-rankers"}
    by_method = {"hyde": "R2MED/R2MED", "query2doc": "R2MED/R2MED", "lamer": "R2MED/R2MED",
                 "search-r1": "PeterGriffinJin/Search-R1", "search-o1": "sunnynexus/Search-o1"}
    seen = set()
    for table in ("frontier", "gar", "agentic"):
        opts = ReproduceOptions(output_dir=tmp_path / "results", generations="fresh")
        planned = plan(load_grid(table), opts)
        text = format_plan(planned)
        assert text.count("\n    prompts: ") == len(planned)
        for p in planned:
            repo = by_reranker.get(p.entry.reranker) or by_method.get(p.entry.method)
            if repo is not None:
                assert p.prompts.startswith(f"the authors', {pins[repo]} (") and p.prompts.endswith(
                    "(without network: r2med-agent prompts import <a clone of "
                    f"{repo} at {pins[repo].rsplit('@', 1)[1]}>)"), (table, p.entry.label, p.prompts)
                assert RunSpec.from_key(p.spec_key).prompts_from == pins[repo]
                seen.add(repo)
            elif p.entry.reranker:
                assert p.prompts == "the project's own", p.entry.label  # InsertRank: no published code
            else:
                assert p.prompts == "none (no LLM reads a prompt in this row)", p.entry.label
    assert seen == set(by_method.values()) | set(by_reranker.values())


def test_prompts_fetch_fetches_every_good_source_and_names_every_bad_one(sources, tmp_path, monkeypatch, capsys) -> None:
    """Issue 39 item 18: `prompts fetch` stopped at the first source it could not have and fetched
    none of the others. Now each good source is fetched, each bad one gets its own error line
    (which says how to do without network, R2MED_PROMPTS_BASE_URL's mirror included), and the
    command exits non-zero (7)."""
    r2med, _ = sources["R2MED"]
    r1, r1_clone = sources["Search-R1"]
    monkeypatch.setattr(ps, "FETCH_BACKOFF_S", 0.01)
    monkeypatch.setenv(ps.BASE_URL_ENV, mirror_files(tmp_path / "mirror", r1, r1_clone).as_uri())  # R2MED's missing
    assert list(ps.prompt_sources()) == ["R2MED", "Search-R1"]  # the bad source comes first
    code = main(["prompts", "fetch"])
    out = capsys.readouterr()
    assert code == 7 and "Traceback" not in out.err
    assert ps.at_hand(r1) and not ps.at_hand(r2med)
    assert f"{r1.short}: search-r1 at hand" in out.out
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, out.err
    assert errors[0].startswith(f"error: {r2med.short}: cannot fetch") and "no such file" in errors[0]
    assert f"{ps.BASE_URL_ENV}=URL" in errors[0] and "r2med-agent prompts import R2MED" in errors[0]
    assert errors[1] == "error: 1 of 2 prompt source(s) could not be fetched: R2MED (each said why above); " \
                        "the others are at hand"
