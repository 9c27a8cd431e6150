"""``prompts import-examples``: R2MED's Query2Doc examples into a prompts folder of your own."""

from __future__ import annotations

from pathlib import Path

import typer

from r2med_agent.cli.app import app

prompts_app = typer.Typer(
    help="Prompt files: import R2MED's own Query2Doc examples into a prompts folder (R2MED_PROMPTS_DIR).",
    no_args_is_help=True,
)
app.add_typer(prompts_app, name="prompts")


@prompts_app.command("import-examples")
def import_examples_command(
    source: Path = typer.Argument(..., help="R2MED's src/example.py (or a file in its layout); read with Python's ast, never run."),
    out: Path = typer.Option(..., "--out", "-o", help="Prompts folder to write query2doc/examples/<family>.yaml into; point R2MED_PROMPTS_DIR at it."),
    force: bool = typer.Option(False, "--force", help="Replace examples files that already exist there."),
) -> None:
    """Turn the reference's per-task Query2Doc examples into examples files keyed by task."""
    from r2med_agent.prompt_examples import read_reference_examples, write_examples

    imported = read_reference_examples(source)
    written = write_examples(imported, out, force=force)
    for task, pairs in imported.examples.items():
        typer.echo(f"{task}: {len(pairs)} example(s) from line {imported.lines[task]}")
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo(f"fresh Query2Doc runs use them with: export R2MED_PROMPTS_DIR={out}")
