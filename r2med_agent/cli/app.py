"""The root typer app; each area registers its commands from its own module."""

from __future__ import annotations

import logging
import sys

import typer

from r2med_agent.errors import R2MedError

app = typer.Typer(
    name="r2med-agent",
    help="Reasoning-augmented medical retrieval on R2MED: query expansion and search agents over BM25 and dense indexes, scored with trec_eval.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Imported here so each module adds its commands to ``app`` (explicit list, no discovery magic).
    from r2med_agent.cli import cache_cmd, compare_cmd, run_cmd, trace_cmd  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Console entry point: user errors print one message and exit non-zero, no traceback."""
    # Our own progress at INFO; other libraries (faiss, httpx, transformers) only when they warn.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("r2med_agent").setLevel(logging.INFO)
    _register()
    try:
        app(args=argv, standalone_mode=False)
    except R2MedError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        return e.exit_code
    except KeyboardInterrupt:
        typer.secho("interrupted; finished work is cached and a re-run resumes", err=True)
        return 130
    except (typer.Exit, SystemExit) as e:  # --help and typer's own exits
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        return int(code or 0)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):
            return 1
        raise
    return 0
