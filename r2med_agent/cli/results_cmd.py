"""``results list`` and ``results migrate``: the result store's folders and their run specs."""

from __future__ import annotations

from pathlib import Path

import typer

from r2med_agent.cli.common import app

results_app = typer.Typer(
    help="List result folders with the settings of their runs; move results written by earlier versions "
         "into folders of their own.",
    no_args_is_help=True,
)
app.add_typer(results_app, name="results")


@results_app.command("list")
def list_command(
    results: Path = typer.Argument(Path("results"), help="The output root (run's --output-dir)."),
) -> None:
    """One line per result folder: its path, tasks, and the run spec's label (settings that differ
    from the defaults in brackets)."""
    from r2med_agent.cli.run_cmd import print_listing
    from r2med_agent.experiment.store import ResultStore

    groups: dict[Path, list] = {}
    for found in ResultStore(results).results():
        groups.setdefault(found.folder, []).append(found)
    rows = []
    for folder, found in groups.items():
        labels = sorted({f.spec.label if f.spec is not None else "(no recorded settings)" for f in found})
        rows.append([str(folder.relative_to(results)), ",".join(f.task for f in found), "; ".join(labels)])
    print_listing("results", ["folder", "tasks", "run"], rows)


@results_app.command("migrate")
def migrate_command(
    results: Path = typer.Argument(Path("results"), help="The output root (run's --output-dir)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the moves without making them."),
) -> None:
    """Move every task result that is not in its own run spec's folder there (results written by
    versions that shared one folder between runs of different settings). Each file moves by one
    rename; nothing is overwritten: a result whose target already holds that task stays put."""
    from r2med_agent.experiment.store import ResultStore

    moves = ResultStore(results).migrate(dry_run=dry_run)
    for src, dest in moves:
        typer.echo(f"{'would move' if dry_run else 'moved'} {src.parent.relative_to(results)}/{src.stem} -> "
                   f"{dest.parent.relative_to(results)}/")
    typer.echo(f"{len(moves)} task result(s) {'to move' if dry_run else 'moved'}")
