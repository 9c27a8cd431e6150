"""configs/pinned/prompt_sources.yaml against the authors' files: every pinned commit is the commit of
the pinned copy, every pinned hash the hash of the authors' file at it, and the files fetched
through a real loopback HTTP server in raw.githubusercontent's layout import into the prompt
folders the entry names (each template marked to render exactly)."""

from __future__ import annotations

import hashlib

import pytest

from r2med_agent import prompt_sources as ps
from r2med_agent import prompt_templates as prompts
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
