"""Everyday command-line habits: Ctrl-C, --version, names as users type them, help text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest


def test_ctrl_c_prints_the_resume_message_and_exits_130(tmp_path, smollm2_gguf):
    """A real SIGINT sent to a run while it generates: one line saying what is kept, no traceback."""
    env = {**os.environ, "R2MED_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "r2med_agent", "run", "--task", "sample", "--method", "hyde",
         "--llm", "smollm2", "--max-tokens", "64", "--no-progress", "-o", str(tmp_path / "out")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen = []
    deadline = time.monotonic() + 300
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if "generating" in line:
            break
    assert proc.poll() is None, "".join(seen)
    time.sleep(1.0)  # inside the model's generation
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "interrupted; finished work is cached and a re-run resumes" in err
    assert "Traceback" not in err and "Aborted" not in err
