"""The root typer app; each area registers its commands from its own module."""

from __future__ import annotations

import logging
import sys

import typer

from r2med_agent import progress
from r2med_agent.cli.common import app
from r2med_agent.errors import R2MedError
from r2med_agent.redaction import redact


def _register() -> None:
    # Imported here so each module adds its commands to ``app`` (explicit list, no discovery magic);
    # the command modules import ``app`` from cli/common.py, never this module.
    from r2med_agent.cli import cache_cmd, compare_cmd, prompts_cmd, results_cmd, run_cmd, trace_cmd  # noqa: F401


def _named_plugins(argv: list[str]) -> None:
    """The ``--plugin`` modules of the command line, added before the commands are made (which
    loads the plugins), so the options a plugin's retriever kind declares are ``run`` options."""
    from r2med_agent.plugins import add_plugin_modules

    add_plugin_modules([argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--plugin"]
                       + [a.split("=", 1)[1] for a in argv if a.startswith("--plugin=")])


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors print one message and exit non-zero, no traceback."""
    # Our own progress at INFO; other libraries (faiss, httpx, transformers) only when they warn.
    # Records go above a progress bar on screen, not into it (progress.log_handler).
    logging.basicConfig(level=logging.WARNING, handlers=[progress.log_handler(sys.stderr)])
    logging.getLogger("r2med_agent").setLevel(logging.INFO)
    try:
        _named_plugins(sys.argv[1:] if argv is None else argv)
        _register()
        # Standalone mode: click prints usage errors (unknown option, bad value) as one message
        # with exit code 2 and handles --help; our own errors propagate to the handler below.
        app(args=argv, standalone_mode=True)
    except R2MedError as e:
        typer.secho(f"error: {redact(str(e))}", fg=typer.colors.RED, err=True)
        return e.exit_code
    except KeyboardInterrupt:
        return _interrupted()
    except SystemExit as e:
        # typer turns Ctrl-C into Exit(130) raised from the KeyboardInterrupt, then sys.exit
        if _caused_by_interrupt(e):
            return _interrupted()
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def _interrupted() -> int:
    typer.secho("interrupted; finished work is cached and a re-run resumes", err=True)
    # Objects the interrupt cut short (a llama.cpp model stopped while it loads) fail in their
    # finalizers as the process ends; after the line above their tracebacks say nothing more.
    sys.unraisablehook = _quiet_unraisable
    return 130


def _quiet_unraisable(unraisable: object) -> None:
    """``sys.unraisablehook`` after a Ctrl-C: finalizer errors of the ending process are dropped."""


def _caused_by_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in ``exc``'s chain of causes and contexts."""
    from r2med_agent.errors import exception_chain

    return any(isinstance(e, KeyboardInterrupt) for e in exception_chain(exc))
