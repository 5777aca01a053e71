"""`moekit corpus build`: the demo model's mixed-domain corpus, from local Debian packages and the stdlib."""

from __future__ import annotations

from pathlib import Path

import typer

from moekit.errors import MoekitError

app = typer.Typer(help="Build the training corpus from local packages.", no_args_is_help=True)

BUILD_HELP = """Build a cleaned, deduplicated, domain-labelled corpus under OUT.

Domains: manpages (English technical prose), python (stdlib source), shell (scripts), fortunes
(short English prose), chinese (manpages-zh). Missing Debian packages are only listed; --install
installs them with apt-get (as root). Writes OUT/{train,heldout}/<domain>.jsonl and
OUT/manifest.json.

Example:  moekit corpus build data/corpus
"""


@app.command("build", help=BUILD_HELP)
def build_cmd(
    out: Path = typer.Argument(..., help="Folder to write the corpus into."),
    install: bool = typer.Option(False, "--install/--no-install", help="Install missing Debian packages with "
                                 "apt-get (as root). Default: only say which are missing; their domains stay empty."),
    seed: int = typer.Option(1234, help="Seed of the train/held-out split and the size cap."),
    heldout: float = typer.Option(0.05, help="Share of documents held out, per domain."),
    max_mb: float = typer.Option(12.0, "--max-mb", help="At most this many MB of text per domain."),
) -> None:
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from moekit.corpus import packages
    from moekit.corpus.build import BuildOptions, build
    from moekit.corpus.sources import default_sources, is_root

    if not 0 < heldout < 1:
        raise MoekitError(f"--heldout must be between 0 and 1, got {heldout}")
    if max_mb <= 0:
        raise MoekitError(f"--max-mb must be positive, got {max_mb}")
    sources = default_sources()
    need = packages.missing([p for s in sources for p in s.packages])
    if need:
        if not install:
            typer.echo(f"missing Debian packages: {' '.join(need)}; their domains will be empty (install them with "
                       f"--install, as root, or: sudo apt-get install {' '.join(need)})")
        elif not is_root():
            typer.echo(f"missing Debian packages: {' '.join(need)}; not root, so not installing "
                       f"(run: sudo apt-get install {' '.join(need)}); their domains may be empty")
        else:
            packages.install(need, typer.echo)
    options = BuildOptions(seed=seed, heldout_fraction=heldout, max_bytes_per_domain=int(max_mb * 1e6))
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} docs read")) as bar:
        tasks: dict[str, int] = {}

        def tick(domain: str) -> None:
            if domain not in tasks:
                tasks[domain] = bar.add_task(domain, total=None)
            bar.advance(tasks[domain])

        manifest = build(out, sources, options, tick)
    for name, d in manifest["domains"].items():
        typer.echo(f"{name:9s} train {d['train_docs']:6d} docs {d['train_bytes'] / 1e6:6.2f} MB   "
                   f"held-out {d['heldout_docs']:5d} docs {d['heldout_bytes'] / 1e6:5.2f} MB   "
                   f"(found {d['found']}, dropped {d['dropped_size']} by size, {d['dropped_duplicate']} duplicates, "
                   f"{d.get('dropped_family_cap', 0)} over the per-family cap)")
    for name in manifest["empty_domains"]:
        typer.echo(f"warning: domain {name!r} is EMPTY (packages: {', '.join(manifest['domains'][name]['packages']) or 'none'})")
    typer.echo(f"wrote {out}/manifest.json")
