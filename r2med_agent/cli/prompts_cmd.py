"""``prompts import``: a reference repository's exact prompts, and ``prompts import-examples``:
R2MED's Query2Doc examples, into a prompts folder of your own."""

from __future__ import annotations

from pathlib import Path

import typer

from r2med_agent.cli.app import app

prompts_app = typer.Typer(
    help="Prompt files: import a reference repository's own prompts (or R2MED's Query2Doc examples) "
         "into a prompts folder (R2MED_PROMPTS_DIR).",
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


@prompts_app.command("import")
def import_command(
    clone: Path = typer.Argument(..., help="Root of a clone of R2MED, Search-R1, Search-o1 or BRIGHT "
                                 "(or a reranker's repository); its files are read with Python's ast, never run."),
    out: Path = typer.Option(..., "--out", "-o", help="Prompts folder to write the templates into; point "
                             "R2MED_PROMPTS_DIR at it."),
    force: bool = typer.Option(False, "--force", help="Replace templates that already exist there."),
) -> None:
    """Write templates that render the reference's own prompts, byte for byte, for fresh runs."""
    from r2med_agent.prompt_import import import_clone, write_prompts

    imported = import_clone(clone)
    written = write_prompts(imported, out, force=force)
    commit = f" at {imported.commit[:12]}" if imported.commit else " (no .git: commit unknown)"
    typer.echo(f"{imported.reference}{commit}: {', '.join(imported.folders)}")
    for rel, origin in sorted(imported.origins.items()):
        typer.echo(f"  {rel} <- {origin}")
    typer.echo(f"wrote {len(written) - 1} template(s) and {written[-1]}")
    typer.echo(f"fresh runs use them with: export R2MED_PROMPTS_DIR={out}")
