"""The tiers that must not pass by skipping (tests/conftest.py, ``REQUIRED_TIERS``): a real test
of each tier, run by pytest in a subprocess where what it needs is missing, skips without its
switch (pytest exits 0) and fails with the skip's reason under it (``R2MED_REQUIRE_CONFORMANCE=1``,
``R2MED_REQUIRE_LUCENE=1``, which ``.ci/run`` exports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = ("R2MED_REQUIRE_CONFORMANCE", "R2MED_REQUIRE_LUCENE", "R2MED_REQUIRE_VLLM")


def _pytest(test: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES and k != "PYTEST_ADDOPTS"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
        cwd=ROOT, env={**base, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        capture_output=True, text=True, timeout=600,
    )


def test_a_conformance_skip_fails_under_its_switch(tmp_path: Path) -> None:
    # The skip comes from the test's own call (reference_repo): the test fails.
    test = "tests/conformance/test_embed_diver.py::test_the_older_copy_is_named_never_found_by_prefix"
    nowhere = {"R2MED_REFERENCE_CODE": str(tmp_path / "no-copies")}
    skipped = _pytest(test, nowhere, tmp_path)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "1 skipped" in skipped.stdout and "is not a folder" in skipped.stdout
    required = _pytest(test, {**nowhere, "R2MED_REQUIRE_CONFORMANCE": "1"}, tmp_path)
    assert required.returncode == 1, required.stdout + required.stderr
    assert "1 failed" in required.stdout and "skipped" not in required.stdout.splitlines()[-1]
    assert f"R2MED_REQUIRE_CONFORMANCE=1 but this test skipped: R2MED_REFERENCE_CODE={tmp_path / 'no-copies'} " \
           "is not a folder" in required.stdout
    # The other tier's switch does not touch this one.
    other = _pytest(test, {**nowhere, "R2MED_REQUIRE_LUCENE": "1"}, tmp_path)
    assert other.returncode == 0 and "1 skipped" in other.stdout


@pytest.mark.slow
def test_a_lucene_parity_skip_fails_under_its_switch(tmp_path: Path) -> None:
    # No Java at all: JAVA_HOME names nothing and PATH holds only this Python's folder. The skip
    # comes from a fixture: the test's setup errors.
    test = "tests/integration/test_lucene_parity.py::test_probes_are_what_real_lucene_says"
    no_java = {"JAVA_HOME": str(tmp_path / "no-jdk"), "PATH": str(Path(sys.executable).parent)}
    skipped = _pytest(test, no_java, tmp_path)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout + skipped.stderr
    assert "real Lucene unavailable" in skipped.stdout
    required = _pytest(test, {**no_java, "R2MED_REQUIRE_LUCENE": "1"}, tmp_path)
    assert required.returncode == 1 and "1 error" in required.stdout, required.stdout + required.stderr
    assert "R2MED_REQUIRE_LUCENE=1 but this test skipped: real Lucene unavailable" in required.stdout
