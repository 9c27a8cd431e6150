"""The typer application every command module adds its commands to, and its root options.

Command modules import ``app`` from here and :mod:`r2med_agent.cli.app` imports the command
modules (its ``_register``), so the CLI has no import circle."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperOption

app = typer.Typer(
    name="r2med-agent",
    help="Reasoning-augmented medical retrieval on R2MED: query expansion and search agents over BM25 and dense indexes, scored with trec_eval.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from r2med_agent import __version__

        typer.echo(f"r2med-agent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    plugin: list[str] = typer.Option(
        [], "--plugin", metavar="MODULE",
        help="Import MODULE as a plugin that registers components (methods, retrievers, rerankers, encoders, "
             "LLM backends); repeatable. $R2MED_PLUGINS (comma-separated) does the same; installed "
             "distributions' 'r2med_agent.plugins' entry points always load.",
    ),
) -> None:
    """Reasoning-augmented medical retrieval on R2MED: query expansion and search agents over BM25 and dense indexes, scored with trec_eval."""
    from r2med_agent.plugins import add_plugin_modules, load_plugins

    add_plugin_modules(plugin)
    load_plugins()  # every command: an installed plugin that fails says so at once


def _flag_type(self: TyperOption, ctx: Any) -> str | None:
    """No type column for on/off flags (typer shows ``<bool>`` beside ``--no-cache``, which takes
    no value); every other option keeps its ``<int>``, ``<path>``, ... tag."""
    return None if self.is_flag else _option_type(self, ctx)


_option_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]
