"""Interrupting real child processes in tests."""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """``preexec_fn`` of a child that a test interrupts: SIGINT back to its default, so that the
    child's Python installs its Ctrl-C handler even where this process ignores SIGINT (a suite
    started as a background job or under nohup: the shell starts it with SIGINT ignored, and a
    child inherits that through exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
