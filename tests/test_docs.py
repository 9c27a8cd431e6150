"""The documentation is true and self-contained: the protocol page the code cites is in the
repository with the sections cited, and nothing points at files outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _repo_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.splitlines()
            if line.endswith((".py", ".md", ".yaml", ".yml", ".j2", ".toml", ".txt"))]


def test_no_file_refers_to_a_protocol_file_outside_the_repository():
    offenders = [str(p.relative_to(ROOT)) for p in _repo_files()
                 if p.is_file() and p.name != "test_docs.py" and "PROTOCOL.md" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_cited_protocol_sections_exist():
    page = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", page, re.MULTILINE)}
    cited = set()
    for p in _repo_files():
        if p.is_file():
            cited |= {" ".join(c.split()) for c in re.findall(r'docs/protocol\.md[,(]? \(?"([^"]+)"', p.read_text(encoding="utf-8"))}
    assert cited, "no section citations found"
    assert cited <= headings, cited - headings
