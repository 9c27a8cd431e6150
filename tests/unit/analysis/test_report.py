"""report: plots, the self-contained HTML page, and its drill-down checked in headless Chromium."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from r2med_agent.api import build_table, load_results
from r2med_agent.evaluation import read_trec_run, trec_sorted
from r2med_agent.analysis.report import drilldown_data, write_report
from tests.browser import CHROMIUM, PageReport, load_page
from tests.result_trees import CORPUS, GOOD, MIXED, QRELS, QUERIES, WEAK, make_task, ranking, write_r2med_task, write_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Twelve documents for q2, so the drill-down cuts the list at ten.
LONG = {**GOOD, "q2": ranking(*[f"d{i}" for i in (8, 9, 10, 11, 12, 13, 14, 15, 1, 3, 2, 4)])}

HOSTILE = "A passage about light </script><script>window.__pwned = 1</script> & <b>bold</b>"


def generations() -> list[dict]:
    rows = [
        {"id": q, "text": t, "hy_doc": HOSTILE if q == "q1" else f"A passage for {q}",
         "doc_id": sorted(QRELS[q]), "reasoning": f"reasoning for {q}", "finish_reason": "stop"}
        for q, t in QUERIES.items()
    ]
    # As the runner writes them: hy_doc is the raw output (R2MED's layout), final the response
    # that became the query. Rows without "final" are R2MED's own files.
    rows[1].update(hy_doc=f"<think>reasoning for {rows[1]['id']}</think> A passage", final="A passage")
    return rows


def traces() -> list[dict]:
    return [
        {"query_id": q, "method": "search-r1", "finish_reason": "answer", "final": f"final answer for {q}",
         "steps": [
             {"generated": "<think>search it</think><search>fever vaccine cause</search>",
              "search_query": "fever vaccine cause", "doc_ids": ["d3", "d11"], "inserted": "Doc 1 (Title: ...)",
              "prompt_tokens": 50, "completion_tokens": 20},
             {"generated": "\n\n<answer>an immune response</answer>\n", "search_query": None, "doc_ids": [],
              "inserted": "", "prompt_tokens": 80, "completion_tokens": 10},
         ], "extra": {}}
        for q in QUERIES
    ]


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    write_result(root, "none", "none", "bm25", "sample", MIXED)
    write_result(root, "hyde", "qwen-7b", "bm25", "sample", LONG, generations=generations(),
                 stats={"generations": 4, "cache_hits": 0, "prompt_tokens": 400, "completion_tokens": 120,
                        "llm_time_s": 2.5, "retrieval_time_s": 0.25, "cost_usd": None})
    write_result(root, "search-r1", "qwen-7b-ins", "bm25", "sample", WEAK, traces=traces(),
                 stats={"generations": 8, "cache_hits": 0, "prompt_tokens": 520, "completion_tokens": 120,
                        "llm_time_s": 5.0, "retrieval_time_s": 0.5, "cost_usd": None})
    return root


@pytest.fixture()
def report(tree: Path, tmp_path: Path) -> Path:
    table = build_table(load_results([tree]), baseline=0)
    return write_report(table, tmp_path / "report", tasks={"sample": make_task()}, doc_chars=12)


def embedded_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="r2med-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def open_page(url: str, **options) -> PageReport:
    """The page loaded in headless Chromium over DevTools (tests/browser.py)."""
    if not CHROMIUM.exists():
        pytest.skip("needs headless Chromium: chromium on PATH or /usr/bin/chromium (apt-get install chromium)")
    return load_page(url, **options)


def clean_page(url: str) -> str:
    """Load ``url``; fail on any script exception, console or log error, external request or image
    that does not decode; return the DOM."""
    page = open_page(url)
    assert page.problems() == []
    assert js_errors(page.dom) == ""
    return page.dom


def js_errors(dom: str) -> str:
    m = re.search(r'<pre id="js-errors"[^>]*>(.*?)</pre>', dom, re.S)
    assert m is not None, "the error box is missing from the page"
    return m.group(1)


def test_report_writes_plots_and_a_self_contained_page(report: Path):
    out = report.parent
    for name in ("per_task.png", "quality_vs_cost.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    page = report.read_text(encoding="utf-8")
    # No network: no external scripts, styles or images; both plots inline. Outside the data block
    # (texts the user's runs hold) the page's own markup, CSS and JS name no URL, CSS url() or
    # @import, and make no fetch/XHR (test_the_page_check_... covers the same in Chromium).
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<link" not in page and "<script src" not in page
    code = re.sub(r'<script type="application/json" id="r2med-data">.*?</script>', "", page, flags=re.S)
    # The plots are inline SVG: their references (clip paths, glyphs) point inside the page only.
    svgs = re.findall(r"<svg\b.*?</svg>", code, flags=re.S)
    assert len(svgs) == 2
    for svg in svgs:
        assert set(re.findall(r'(?:href="|url\()(.)', svg)) == {"#"}
        assert "<script" not in svg and "<!--" not in svg
    code = re.sub(r"<svg\b.*?</svg>", "", code, flags=re.S)
    for needle in ("url(", "@import", "fetch(", "XMLHttpRequest", "http://", "https://", "//cdn"):
        assert needle not in code, needle
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # two figures on one page share no id
    # The hostile generated text cannot close the data script early: every script tag pairs up,
    # and the data block parses whole (test_drilldown_data_matches_the_run_files reads it back).
    assert page.count("</script>") == page.count("<script")
    assert "<script>window.__pwned" not in page
    # The comparison table is in the page.
    assert "hyde" in page and "search-r1" in page and "0 (base)" in page


def test_report_shows_per_task_tests_against_the_baseline(tree: Path, tmp_path: Path):
    table = build_table(load_results([tree]), baseline=0, test="bootstrap", n_resamples=500)
    page = write_report(table, tmp_path / "rep", tasks={"sample": make_task()}).read_text(encoding="utf-8")
    sig = re.search(r'<table class="cmp sig" id="sig-table">(.*?)</table>', page, re.S)
    assert sig is not None
    rows = re.findall(r'<tr data-row="(\d+)">(.*?)</tr>', sig.group(1), re.S)
    assert [r for r, _ in rows] == ["1", "2"]  # every row but the baseline
    assert "<th>Avg</th>" not in sig.group(1)  # one task: an Avg column would repeat it
    for (index, html), tr in zip(rows, table.rows[1:]):
        t = tr.tests["sample"]
        cells = re.findall(r"<td[^>]*>(.*?)</td>", html)
        assert cells[1] == tr.row.label
        assert cells[2] == (
            f"Δ {t.mean_diff:+.4f} [{t.ci_low:+.4f}, {t.ci_high:+.4f}], p {t.p_value:.4f}, "
            f"W/T/L {t.wins}/{t.ties}/{t.losses}"
        )


def test_drilldown_data_matches_the_run_files(report: Path, tree: Path):
    data = embedded_data(report.read_text(encoding="utf-8"))
    labels = [r["label"] for r in data["rows"]]
    assert labels == ["none/none/bm25", "hyde/qwen-7b/bm25", "search-r1/qwen-7b-ins/bm25"]
    run = read_trec_run(tree / "hyde/qwen-7b/bm25/sample.run")
    q2 = data["results"]["1"]["sample"]["q2"]
    assert [d for d, _ in q2["top"]] == [d for d, _ in trec_sorted(run["q2"])[:10]]
    assert q2["run_length"] == 12
    assert q2["relevant_ranks"] == {"d2": 11}  # relevant, but below the top 10
    assert data["results"]["1"]["sample"]["q1"]["generation"]["text"] == HOSTILE
    assert data["results"]["1"]["sample"]["q2"]["generation"]["text"] == "A passage"  # the final response
    steps = data["results"]["2"]["sample"]["q3"]["trace"]["steps"]
    assert steps[0]["search_query"] == "fever vaccine cause"
    # A step that continues after inserted documents starts with newlines: shown without them.
    assert steps[1]["generated"] == "<answer>an immune response</answer>"
    task = data["tasks"]["sample"]
    assert task["queries"] == QUERIES and task["qrels"] == QRELS
    # Document texts: only documents some row shows in its top 10, cut to doc_chars.
    shown = {d for row in data["results"].values() for q in row["sample"].values() for d, _ in q["top"]}
    assert set(task["docs"]) == shown
    assert "d6" in CORPUS and "d6" not in task["docs"]  # in the corpus, never ranked
    assert task["docs"]["d1"].startswith(CORPUS["d1"][:12]) and "more characters" in task["docs"]["d1"]


def test_coinciding_points_share_one_label():
    from r2med_agent.analysis.plots import _clusters

    # Rows 0 and 1 both at x=0 (no LLM cost) with nearly the same score; row 2 far away; row 3
    # at x=0 with another score.
    points = [(0.0, 0.500), (0.0, 0.502), (3.0, 0.6), (0.0, 0.3)]
    assert _clusters(points, dx=0.09, dy=0.012) == [[0, 1], [2], [3]]


def test_drilldown_without_task_data_uses_the_generations_file(tree: Path):
    table = build_table(load_results([tree]))
    data = drilldown_data(table, tasks=None)
    task = data["tasks"]["sample"]
    assert task["qrels_source"] == "generations"
    assert task["queries"] == QUERIES
    assert task["qrels"]["q3"] == {"d3": 1, "d7": 1}
    # Also rows without a generations file (row 0, BM25 before HyDE) get relevance marks.
    assert data["results"]["0"]["sample"]["q3"]["relevant_ranks"] == {"d3": None, "d7": 1}
    assert task["docs"] == {}


def test_chromium_opens_the_drilldown_from_the_url_fragment(report: Path, tmp_path: Path):
    dom = clean_page(report.as_uri() + "#row=1&task=sample&query=q1")
    m = re.search(r'<div id="drilldown"[^>]*data-row="1"[^>]*>(.*)', dom, re.S)
    assert m is not None, "the drill-down did not open row 1"
    drill = m.group(1)
    assert 'data-query="q1"' in dom
    # Top documents of q1 in rank order, the relevant ones marked.
    ids = re.findall(r'<li class="doc( relevant)?" data-doc-id="([^"]+)"', drill)
    assert ids == [(" relevant", "d1"), (" relevant", "d5"), ("", "d9")]
    assert drill.count(">RELEVANT<") == 2
    assert QUERIES["q1"] in drill
    # The hostile generated text is shown as text, not parsed as markup.
    assert "&lt;/script&gt;&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in drill
    assert "reasoning for q1" in drill


def test_chromium_shows_an_agent_trace_and_missed_relevant_documents(report: Path, tmp_path: Path):
    dom = clean_page(report.as_uri() + "#row=2&task=sample&query=q3")
    trace = re.search(r'<div id="dd-trace">(.*?)</div>\s*<h3>Final response', dom, re.S)
    assert trace is not None
    assert "search: fever vaccine cause" in trace.group(1) and "retrieved: d3, d11" in trace.group(1)
    assert "final answer for q3" in dom
    assert re.search(r'<li class="doc relevant" data-doc-id="d3">.*?RELEVANT \(grade 2\)', dom, re.S)
    assert "d7 (not retrieved)" in dom


def test_the_error_box_catches_script_errors(report: Path, tmp_path: Path):
    broken = tmp_path / "broken.html"
    page = report.read_text(encoding="utf-8")
    broken.write_text(page.replace("</body>", "<script>noSuchFunction();</script></body>"), encoding="utf-8")
    loaded = open_page(broken.as_uri())
    assert "noSuchFunction" in js_errors(loaded.dom)
    assert any("noSuchFunction" in e for e in loaded.exceptions)


@pytest.mark.parametrize(
    ("injected", "kind", "needle"),
    [
        ('<script>console.error("drill-down broke")</script>', "console error", "drill-down broke"),
        ('<img alt="x" src="data:image/png;base64,AAAA">', "image did not decode", "data:image/png;base64,AAAA"),
        ("<style>body { background: url(http://example.invalid/bg.png); }</style>", "external request",
         "http://example.invalid/bg.png"),
        ('<style>@import url("https://example.invalid/theme.css");</style>', "external request",
         "https://example.invalid/theme.css"),
        ('<script>fetch("https://example.invalid/data.json").catch(function () {});</script>', "external request",
         "https://example.invalid/data.json"),
        ('<img alt="x" src="per_task.png">', "external request", "/per_task.png"),
    ],
)
def test_the_page_check_catches_what_a_static_page_must_not_do(report: Path, tmp_path: Path, injected, kind, needle):
    # The checker behind clean_page is only worth something if it fails: one fault at a time.
    bad = report.parent / "bad.html"  # beside per_task.png: a relative reference would load
    bad.write_text(report.read_text(encoding="utf-8").replace("</body>", injected + "</body>"), encoding="utf-8")
    problems = open_page(bad.as_uri()).problems()
    assert any(p.startswith(kind) and needle in p for p in problems), problems


def chromium(tmp_path: Path, url: str, *extra: str) -> str:
    if not CHROMIUM.exists():
        pytest.skip("needs headless Chromium: chromium on PATH or /usr/bin/chromium (apt-get install chromium)")
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    cmd = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", *extra, url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_chromium_screenshot(report: Path, tmp_path: Path):
    shot = tmp_path / "report.png"
    chromium(
        tmp_path, report.as_uri() + "#row=1&task=sample&query=q1",
        f"--screenshot={shot}", "--window-size=1300,2200", "--hide-scrollbars",
    )
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000


LEGEND_BOXES_JS = """JSON.stringify(Array.from(document.querySelectorAll('.plots figure svg')).map(function (svg) {
  var box = function (e) { var r = e.getBoundingClientRect();
    return [r.left + window.scrollX, r.top + window.scrollY, r.right + window.scrollX, r.bottom + window.scrollY]; };
  return {svg: box(svg), labels: Array.from(svg.querySelectorAll('[id*="legend-label-"]')).map(box)};
}))"""


def sweep_tree(root: Path) -> Path:
    """A temperature x max-tokens sweep of HyDE (six rows whose labels differ only at their end)
    and one row with every setting a label can carry, so the legend's labels are long."""
    runs = [MIXED, GOOD, WEAK, MIXED, GOOD, WEAK]
    i = 0
    for temperature in (0.0, 0.7, 1.0):
        for max_tokens in (64, 512):
            leaf = write_result(root, "hyde", "smollm2", "bm25", "sample", runs[i],
                                config={"sampling": {"temperature": temperature, "max_tokens": max_tokens}})
            leaf.rename(leaf.parent / f"bm25__v{i}")
            i += 1
    write_result(root, "query2doc", "qwen-72b", "bm25", "sample", LONG, config={
        "sampling": {"temperature": 0.7, "max_tokens": 2048, "top_p": 0.95}, "top_k": 50, "bm25_k1": 1.2,
        "bm25_b": 0.75, "empty_generation": "keep", "exclude_identical_ids": True})
    return root


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(PNG_MAGIC)
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_legends_fit_their_plots_in_chromium_and_in_the_pngs(tmp_path: Path):
    """Issue 30 item 4: the legend of each plot lies inside its image, every label whole (long
    ones wrapped). In the page, Chromium lays the report out and measures the bounding box of each
    legend label (the plots are inline SVG) against its plot's and the page screenshot's; in the
    PNG files beside it, nothing is drawn on the image's outermost pixels (a cut legend touched
    both side edges of ``per_task.png``) and matplotlib's own text boxes lie inside the figure."""
    import numpy as np
    from matplotlib.image import imread

    from r2med_agent.analysis.report import per_task_figure, quality_figure

    table = build_table(load_results([sweep_tree(tmp_path / "results")]), baseline=0)
    assert max(len(r.row.label) for r in table.rows) > 110  # wider than a plot at the legend's font size
    page = write_report(table, tmp_path / "report", tasks={"sample": make_task()})
    shown = open_page(page.as_uri(), evaluate=[LEGEND_BOXES_JS], screenshot=True)
    assert shown.problems() == []
    width, height = _png_size(shown.screenshot)
    plots = json.loads(shown.values[0])
    assert len(plots) == 2
    for plot in plots:
        left, top, right, bottom = plot["svg"]
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        assert len(plot["labels"]) == len(table.rows)
        for x0, y0, x1, y1 in plot["labels"]:
            assert left <= x0 < x1 <= right and top <= y0 < y1 <= bottom, (plot["svg"], (x0, y0, x1, y1))
    out = page.parent
    for name in ("per_task.png", "quality_vs_cost.png"):
        pixels = imread(out / name)[..., :3]
        edges = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        assert (edges > 0.99).all(), f"{name}: something is drawn on the image's edge"
    for make in (per_task_figure, quality_figure):
        fig = make(table)
        fig.canvas.draw()
        bounds = fig.bbox
        texts = [t for legend in fig.legends for t in legend.get_texts()]
        assert len(texts) == len(table.rows)
        for t in texts:
            box = t.get_window_extent()
            assert bounds.x0 <= box.x0 and box.x1 <= bounds.x1 and bounds.y0 <= box.y0 and box.y1 <= bounds.y1
        import matplotlib.pyplot as plt

        plt.close(fig)


@pytest.fixture()
def cli():
    from r2med_agent.cli.app import _register
    from r2med_agent.cli.common import app

    _register()
    return app


def test_cli_report_loads_task_texts_from_data_dir(cli, tree: Path, tmp_path: Path):
    data_dir = tmp_path / "data"
    write_r2med_task(data_dir / "sample")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["report", str(tree), "--out", str(out), "--data-dir", str(data_dir), "--published",
                                   "--allow-count-mismatch"])
    assert res.exit_code == 0, res.output
    page = (out / "report.html").read_text(encoding="utf-8")
    data = embedded_data(page)
    assert data["tasks"]["sample"]["qrels_source"] == "qrels"
    assert data["tasks"]["sample"]["docs"]["d9"] == CORPUS["d9"]
    assert (out / "per_task.png").exists() and (out / "quality_vs_cost.png").exists()


def test_cli_report_takes_tasks_whose_qrels_name_missing_documents(cli, tree: Path, tmp_path: Path):
    # As R2MED's own demo files: a relevant document that is not in the corpus.
    data_dir = tmp_path / "data"
    write_r2med_task(data_dir / "sample")
    with (data_dir / "sample" / "qrels.jsonl").open("a") as f:
        f.write(json.dumps({"q_id": "q1", "p_id": "not-in-corpus", "score": 1}) + "\n")
    runner = CliRunner()
    res = runner.invoke(cli, ["report", str(tree), "--out", str(tmp_path / "a"), "--data-dir", str(data_dir),
                              "--allow-count-mismatch"])
    assert res.exit_code != 0 and "--allow-missing-qrels-docs" in str(res.exception)
    res = runner.invoke(cli, ["report", str(tree), "--out", str(tmp_path / "b"), "--data-dir", str(data_dir),
                              "--allow-count-mismatch",
                              "--allow-missing-qrels-docs"])
    assert res.exit_code == 0, res.output
    data = embedded_data((tmp_path / "b" / "report.html").read_text(encoding="utf-8"))
    assert data["tasks"]["sample"]["qrels"]["q1"] == {**QRELS["q1"], "not-in-corpus": 1}


def test_cli_report_takes_the_compare_options(cli, tree: Path, tmp_path: Path):
    out = tmp_path / "out"
    args = ["report", str(tree), "--out", str(out), "--no-texts", "--baseline", "0", "--test", "bootstrap",
            "--resamples", "300", "--seed", "7", "--cost"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    page = (out / "report.html").read_text(encoding="utf-8")
    table = build_table(load_results([tree]), baseline=0, test="bootstrap", n_resamples=300, seed=7, cost=True)
    t = table.rows[1].tests["sample"]
    assert f"Δ {t.mean_diff:+.4f} [{t.ci_low:+.4f}, {t.ci_high:+.4f}], p {t.p_value:.4f}" in page
    assert "300 resamples" in page
    # --cost adds the stats columns; the unpriced rows show no dollars.
    assert "<th>prompt tok</th>" in page and "<th>cost $</th>" in page
    assert "0.0000" not in re.sub(r"Δ [^<]*", "", page.split('id="cmp-table"')[1].split("</table>")[0])


def test_cli_report_without_texts_and_with_missing_data(cli, tree: Path, tmp_path: Path):
    runner = CliRunner()
    res = runner.invoke(cli, ["report", str(tree), "--out", str(tmp_path / "a"), "--no-texts", "--cost-axis", "time"])
    assert res.exit_code == 0, res.output
    assert embedded_data((tmp_path / "a" / "report.html").read_text())["tasks"]["sample"]["docs"] == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(cli, ["report", str(tree), "--out", str(tmp_path / "b"), "--data-dir", str(empty)])
    assert res.exit_code != 0
    assert "--no-texts" in str(res.exception) and "no data for task sample" in str(res.exception)
    res = runner.invoke(cli, ["report", str(tree), "--out", str(tmp_path / "c"), "--no-texts", "--cost-axis", "euros"])
    assert "usd, tokens" in str(res.exception)


def _own_task(folder: Path, marker: str) -> None:
    """A task of your own in R2MED layout; ``marker`` in d1's text tells the folders apart."""
    write_r2med_task(folder)
    lines = (folder / "corpus.jsonl").read_text().splitlines()
    lines = [json.dumps({"id": "d1", "text": marker}) if json.loads(x)["id"] == "d1" else x for x in lines]
    (folder / "corpus.jsonl").write_text("\n".join(lines) + "\n")


def _run_own_tasks(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two own-data folders, each run (real BM25, real CLI) into one result tree."""
    from r2med_agent.cli.app import main

    first, second = tmp_path / "lab-a", tmp_path / "lab-b"
    _own_task(first / "Alpha", "insects fly towards light: alpha copy")
    _own_task(second / "Beta", "insects fly towards light: beta copy")
    results = tmp_path / "results"
    for folder in (first, second):
        assert main(["run", "--data-dir", str(folder), "-o", str(results), "--no-progress"]) == 0
    return results, first, second


def test_cli_report_on_own_data_uses_the_folders_the_results_record(cli, tmp_path: Path):
    """Item 6: no --data-dir needed; each task's texts come from the folder its run used."""
    results, _, _ = _run_own_tasks(tmp_path)
    res = CliRunner().invoke(cli, ["report", str(results), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, f"{res.output} {res.exception}"
    data = embedded_data((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    assert sorted(data["tasks"]) == ["Alpha", "Beta"]
    assert data["tasks"]["Alpha"]["queries"]["q1"] == QUERIES["q1"]
    shown = {name: data["tasks"][name]["docs"].get("d1") for name in ("Alpha", "Beta")}
    assert shown == {"Alpha": "insects fly towards light: alpha copy", "Beta": "insects fly towards light: beta copy"}


def test_cli_report_takes_several_data_dirs_and_a_second_does_not_replace_the_first(cli, tmp_path: Path):
    results, first, second = _run_own_tasks(tmp_path)
    moved_a, moved_b = tmp_path / "moved-a", tmp_path / "moved-b"
    first.rename(moved_a)  # the recorded folders are gone: only --data-dir can say where
    second.rename(moved_b)
    runner = CliRunner()
    res = runner.invoke(cli, ["report", str(results), "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--data-dir" in str(res.exception)
    res = runner.invoke(cli, ["report", str(results), "--out", str(tmp_path / "out"),
                              "--data-dir", str(moved_a), "--data-dir", str(moved_b)])
    assert res.exit_code == 0, f"{res.output} {res.exception}"
    data = embedded_data((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    assert data["tasks"]["Alpha"]["docs"].get("d1") == "insects fly towards light: alpha copy"
    assert data["tasks"]["Beta"]["docs"].get("d1") == "insects fly towards light: beta copy"


def test_report_and_tasks_take_config(cli, tmp_path: Path):
    """Item 6: a task defined in a user config (--config) is listed by ``tasks`` and found by
    ``report``."""
    folder = tmp_path / "cardio"
    _own_task(folder, "insects fly towards light: cardio copy")
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(f"tasks:\n  Cardio: {{family: case, domain: cardiology, source: local, path: {json.dumps(str(folder))}}}\n")
    runner = CliRunner()
    res = runner.invoke(cli, ["tasks", "--config", str(cfg)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "Cardio" in res.output
    results = tmp_path / "results"
    res = runner.invoke(cli, ["run", "--task", "Cardio", "--config", str(cfg), "-o", str(results), "--no-progress"])
    assert res.exit_code == 0, f"{res.output} {res.exception}"
    res = runner.invoke(cli, ["report", str(results), "--config", str(cfg), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, f"{res.output} {res.exception}"
    data = embedded_data((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    assert data["tasks"]["Cardio"]["docs"].get("d1") == "insects fly towards light: cardio copy"


def _beir_task(folder: Path, marker: str) -> None:
    """A task of your own in BEIR layout with a test and a dev split; ``marker`` is d1's text."""
    (folder / "qrels").mkdir(parents=True)
    with (folder / "queries.jsonl").open("w") as f:
        for qid, text in QUERIES.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    with (folder / "corpus.jsonl").open("w") as f:
        for did, text in CORPUS.items():
            f.write(json.dumps({"_id": did, "title": "", "text": marker if did == "d1" else text}) + "\n")
    qids = sorted(QRELS)
    for split, chosen in (("test", qids[:-1]), ("dev", qids[-1:])):
        lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{g}" for q in chosen for d, g in QRELS[q].items()]
        (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")


def test_cli_report_finds_the_texts_of_every_layout(cli, tmp_path: Path):
    """Issue 30 item 2: a result records its data folder as data (``"data"``: folder, layout,
    name, split), and ``report`` without --data-dir finds the texts of BEIR folders (each split
    its own task), R2MED-layout folders and Nano-layout copies; ``report`` used to stop with
    ``unknown task 'mini-med'`` because the BEIR folder's source reads ``<folder> (split test)``."""
    from r2med_agent.cli.app import main
    from tests.unit.data.test_data import make_nano_snapshot

    beir, own = tmp_path / "mini-med", tmp_path / "lab" / "Alpha"
    _beir_task(beir, "insects fly towards light: beir copy")
    _own_task(own, "insects fly towards light: r2med copy")
    nano = make_nano_snapshot(tmp_path / "NanoR2MED", "NanoR2MEDBiology", "jsonl")
    results = tmp_path / "results"
    for args in (["--data-dir", str(beir)], ["--data-dir", str(beir), "--split", "dev"],
                 ["--data-dir", str(beir), "--all-queries"], ["--data-dir", str(own)],
                 ["--data-dir", str(nano), "--task", "nano-Biology", "--allow-count-mismatch"]):
        assert main(["run", *args, "-o", str(results), "--no-progress"]) == 0, args
    record = json.loads((results / "none" / "none" / "bm25" / "mini-med@dev.json").read_text())
    assert record["data"] == {"folder": str(beir.resolve()), "layout": "beir", "name": "mini-med", "split": "dev",
                              "all_queries": False}
    record = json.loads((results / "none" / "none" / "bm25" / "nano-Biology.json").read_text())
    assert record["data"]["folder"] == str(nano.resolve()) and record["data"]["layout"] == "nano"
    res = CliRunner().invoke(cli, ["report", str(results), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, f"{res.output} {res.exception}"
    data = embedded_data((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    assert sorted(data["tasks"]) == ["Alpha", "mini-med", "mini-med@dev", "mini-med@test-all", "nano-Biology"]
    qids = sorted(QRELS)
    assert sorted(data["tasks"]["mini-med"]["queries"]) == qids[:-1]
    assert sorted(data["tasks"]["mini-med@dev"]["queries"]) == qids[-1:]
    assert sorted(data["tasks"]["mini-med@test-all"]["queries"]) == sorted(QUERIES)
    assert data["tasks"]["mini-med@test-all"]["docs"].get("d1") == "insects fly towards light: beir copy"
    assert data["tasks"]["mini-med@dev"]["qrels"] == {q: QRELS[q] for q in qids[-1:]}
    assert data["tasks"]["Alpha"]["docs"].get("d1") == "insects fly towards light: r2med copy"
    assert data["tasks"]["nano-Biology"]["queries"] == {"0": "first query", "1": "second query"}
    # Results of the registry's own tasks record no folder: they load by name.
    assert main(["run", "--task", "sample", "-o", str(results), "--no-progress"]) == 0
    sample = json.loads((results / "none" / "none" / "bm25" / "sample.json").read_text())["data"]
    assert sample["folder"] is None and sample["layout"] == "r2med"


def test_cli_report_reads_results_that_record_no_data_block(cli, tmp_path: Path):
    """Results written before the ``data`` block: the folder comes from the ``source`` prose
    (``<folder> (split dev)``) and the split from the recorded config."""
    from r2med_agent.cli.app import main

    beir = tmp_path / "mini-med"
    _beir_task(beir, "insects fly towards light: beir copy")
    results = tmp_path / "results"
    assert main(["run", "--data-dir", str(beir), "--split", "dev", "-o", str(results), "--no-progress"]) == 0
    path = results / "none" / "none" / "bm25" / "mini-med@dev.json"
    record = json.loads(path.read_text())
    assert record["source"] == f"{beir.resolve()} (split dev)"
    del record["data"]
    path.write_text(json.dumps(record))
    res = CliRunner().invoke(cli, ["report", str(results), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, f"{res.output} {res.exception}"
    data = embedded_data((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))
    assert sorted(data["tasks"]["mini-med@dev"]["queries"]) == sorted(QRELS)[-1:]


def test_the_significance_note_names_the_test_that_ran(tree: Path, tmp_path: Path):
    """Issue 39 item 18: the note under the significance table named the bootstrap and a 95%
    interval whatever ran; with the permutation test (the default) there is no interval."""
    for test, says, never in (("permutation", "paired randomisation (permutation) test", "95%"),
                              ("bootstrap", "95% bootstrap interval", "permutation")):
        table = build_table(load_results([tree]), baseline=0, test=test, n_resamples=200)
        page = write_report(table, tmp_path / test, tasks={"sample": make_task()}).read_text(encoding="utf-8")
        note = re.search(r'<p class="notes">(Per cell:.*?)</p>', page, re.S)
        assert note is not None
        assert says in note.group(1) and never not in note.group(1), note.group(1)


def test_every_row_of_a_long_table_gets_its_own_plot_colour(tmp_path: Path):
    """Issue 39 item 18: past 20 rows the palette started over (row 20 drawn as row 0)."""
    import matplotlib.pyplot as plt

    from r2med_agent.analysis.report import per_task_figure

    root = tmp_path / "results"
    for i in range(23):
        leaf = write_result(root, "hyde", "smollm2", "bm25", "sample", (MIXED, GOOD, WEAK)[i % 3],
                            config={"sampling": {"temperature": round(0.05 * i, 2), "max_tokens": 64}})
        leaf.rename(leaf.parent / f"bm25__v{i}")
    table = build_table(load_results([root]))
    assert len(table.rows) == 23
    fig = per_task_figure(table)
    colours = [tuple(round(c, 4) for c in bars.patches[0].get_facecolor()) for bars in fig.axes[0].containers]  # one task: one bar each
    plt.close(fig)
    assert len(colours) == 23 and len(set(colours)) == 23
