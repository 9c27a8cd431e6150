"""The ``r2med-agent`` command line: thin typer commands over the library."""

from __future__ import annotations

from r2med_agent.cli.app import main
from r2med_agent.cli.common import app

__all__ = ["app", "main"]
