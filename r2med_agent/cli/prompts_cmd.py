"""``prompts import``: a reference repository's exact prompts, and ``prompts import-examples``:
R2MED's Query2Doc examples, into a prompts folder of your own."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from r2med_agent.cli.common import app

prompts_app = typer.Typer(
    help="Prompt files: the authors' prompts at pinned commits (fetch, list, import from a clone), or a "
         "reference's prompts or R2MED's Query2Doc examples imported into a prompts folder (R2MED_PROMPTS_DIR).",
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
    from r2med_agent.prompts.examples import read_reference_examples, write_examples

    imported = read_reference_examples(source)
    written = write_examples(imported, out, force=force)
    for task, pairs in imported.examples.items():
        typer.echo(f"{task}: {len(pairs)} example(s) from line {imported.lines[task]}")
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo(f"fresh Query2Doc runs use them with: export R2MED_PROMPTS_DIR={out}")


@prompts_app.command("import")
def import_command(
    clone: Path = typer.Argument(..., help="Root of a clone of R2MED, Search-R1, Search-o1, BRIGHT, ReasonRank, rank1, "
                                 "Diver (GroupRank) or llm-rankers (Rank-R1); its files are read with Python's ast "
                                 "(TOML as data), never run."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Prompts folder to write the templates into (any "
                                       "commit, recorded); point R2MED_PROMPTS_DIR at it. Without --out: the "
                                       "clone must be at the commit configs/pinned/prompt_sources.yaml pins, and its "
                                       "files go into the cache, where runs with the authors' prompts find them "
                                       "(the way to work without network)."),
    force: bool = typer.Option(False, "--force", help="Replace templates that already exist in --out."),
) -> None:
    """Import a reference's own prompts: into the cache at the pinned commit, or into --out."""
    if out is None:
        from r2med_agent.prompts.sources import install_clone

        source = install_clone(clone)
        typer.echo(f"{source.short}: {', '.join(source.folders)} at hand for runs with the authors' prompts "
                   f"({source.folder})")
        return
    from r2med_agent.prompts.importer import import_clone, write_prompts

    imported = import_clone(clone)
    written = write_prompts(imported, out, force=force)
    commit = f" at {imported.commit[:12]}" if imported.commit else " (no .git: commit unknown)"
    typer.echo(f"{imported.reference}{commit}: {', '.join(imported.folders)}")
    for rel, origin in sorted(imported.origins.items()):
        typer.echo(f"  {rel} <- {origin}")
    typer.echo(f"wrote {len(written) - 1} template(s) and {written[-1]}")
    typer.echo(f"fresh runs with --prompts own use them with: export R2MED_PROMPTS_DIR={out}")


@prompts_app.command("fetch")
def fetch_command(
    names: Optional[list[str]] = typer.Argument(None, help="Sources to fetch (names or owner/repo, see `prompts "
                                                "sources`); default: all of them."),
) -> None:
    """Fetch the authors' prompts at their pinned commits into the cache now (runs fetch on first use).
    Every source that can be fetched is; each one that cannot is named on its own line, and the
    command then exits non-zero."""
    from r2med_agent.errors import PromptSourceError, R2MedError
    from r2med_agent.prompts.sources import base_url, ensure, sources_named
    from r2med_agent.redaction import redact

    sources = sources_named(names or [])
    failed: list[str] = []
    for source in sources:
        try:
            ensure(source)
        except R2MedError as e:
            typer.secho(f"error: {source.short}: {redact(str(e))}", fg=typer.colors.RED, err=True)
            failed.append(source.name)
            continue
        typer.echo(f"{source.short}: {', '.join(source.folders)} at hand ({source.folder})")
    typer.echo(f"from {redact(base_url())}")
    if failed:
        raise PromptSourceError(f"{len(failed)} of {len(sources)} prompt source(s) could not be fetched: "
                                f"{', '.join(failed)} (each said why above); the others are at hand")


@prompts_app.command("sources")
def sources_command() -> None:
    """List the authors' prompts the project fetches: repository, pinned commit, folders, whether at hand."""
    from r2med_agent.cli.run_cmd import print_listing
    from r2med_agent.prompts.sources import listing

    print_listing("the authors' prompts (configs/pinned/prompt_sources.yaml)",
                  ["name", "repo@commit", "prompt folders", "at hand", "what"], listing())
