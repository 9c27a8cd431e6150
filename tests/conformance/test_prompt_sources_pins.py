"""configs/pinned/prompt_sources.yaml against the authors' files: every pinned commit is the commit of
the pinned copy, every pinned hash the hash of the authors' file at it, and the files fetched
through a real loopback HTTP server in raw.githubusercontent's layout import into the prompt
folders the entry names (each template marked to render exactly).

What of a full commit can be checked here: the pinned copies carry no ``.git`` and name their
commit by its first 12 hex digits (the folder's ``@<commit>``), so the other 28 digits of a pin
cannot be recomputed from them (a commit's hash covers its tree, parents, author and message,
which the copies do not hold). The tests check what the copies and the project do hold: the pin
is 40 lower-case hex digits that start with the copy's 12, the copy's files hash as pinned, and
every commit of that repository the project names anywhere (docs, configs, templates, code,
``owner/repo@<hex>`` or a GitHub URL) agrees with the full pin digit for digit, or names another
pinned copy of it (``older/``). The full commits were checked against GitHub's history when
they were pinned (each pinned file's SHA-256 at the full commit)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from r2med_agent.prompts import sources as ps
from r2med_agent.prompts import templates as prompts
from tests.conformance.conftest import reference_commit, reference_repo
from tests.prompt_mirror import LoopbackMirror, mirror_files

SOURCES = ps.prompt_sources()


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_pins_are_the_authors_files(name) -> None:
    source = SOURCES[name]
    copy = reference_repo(source.repo)
    assert source.commit.startswith(reference_commit(copy)) and len(source.commit) == 40
    for rel, sha in source.files.items():
        assert hashlib.sha256((copy / rel).read_bytes()).hexdigest() == sha, rel


ROOT = Path(__file__).resolve().parents[2]
LONG_HEX = re.compile(r"(?<![0-9a-f])[0-9a-f]{13,40}(?![0-9a-f])")
MENTION = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)@([0-9a-f]{7,40})(?![0-9a-f])"
                     r"|github\.com/([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)/(?:blob|tree|commit)/([0-9a-f]{7,40})(?![0-9a-f])")


def commit_mentions(repo: str, short: str) -> list[tuple[str, str]]:
    """``(file:line, hex)`` for every commit of ``repo`` the project names: ``repo@<hex>``, a
    GitHub URL at a commit, or a longer hex string that starts with the copy's ``short`` commit,
    in the package, the docs, the README and the tests."""
    out = []
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "r2med_agent").rglob("*"),
             *(ROOT / "tests").rglob("*.py")]
    for path in files:
        if not path.is_file() or path.suffix not in (".md", ".py", ".yaml", ".j2", ".toml"):
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in MENTION.finditer(line):
                name, commit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                if name == repo:
                    out.append((f"{path.relative_to(ROOT)}:{lineno}", commit))
            for m in LONG_HEX.finditer(line):
                if m.group().startswith(short):
                    out.append((f"{path.relative_to(ROOT)}:{lineno}", m.group()))
    return out


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_full_commit_is_the_one_every_place_names(name) -> None:
    """The pin's full 40-hex commit against the copy's 12 and every commit of the repository the
    project names (see the module docstring for what cannot be checked from the copies)."""
    source = SOURCES[name]
    copy = reference_repo(source.repo)
    assert re.fullmatch(r"[0-9a-f]{40}", source.commit), source.commit
    short = reference_commit(copy)
    assert re.fullmatch(r"[0-9a-f]{12}", short) and source.commit[:12] == short
    pattern = copy.name.split("@")[0] + "@*"
    others = {reference_commit(p) for p in (*copy.parent.glob(pattern), *copy.parent.glob(f"older/{pattern}"))} - {short}
    mentions = commit_mentions(source.repo, short)
    for where, commit in mentions:
        if any(commit.startswith(o) or o.startswith(commit) for o in others):
            continue  # another pinned copy of the repository (a history the docs tell)
        assert source.commit.startswith(commit), f"{where}: {source.repo}@{commit}, pinned {source.commit}"


@pytest.mark.parametrize("name", list(SOURCES))
def test_fetched_over_http_they_import_into_the_named_folders(name, tmp_path, monkeypatch) -> None:
    source = SOURCES[name]
    copy = reference_repo(source.repo)
    monkeypatch.setenv("R2MED_CACHE_DIR", str(tmp_path / "cache"))
    with LoopbackMirror(mirror_files(tmp_path / "mirror", source, copy)) as server:
        monkeypatch.setenv(ps.BASE_URL_ENV, server.url)
        templates = ps.ensure(source)
    assert sorted(p.name for p in templates.iterdir() if p.is_dir()) == sorted(source.folders)
    for folder in source.folders:
        assert prompts.renders_exactly(f"{folder}/qa.j2", prompts_dir=templates)
