"""`moekit`: one command, a subcommand per capability.

Each subcommand lives in `moekit.commands.<name>` and is imported only when used, so
`moekit calc` never imports torch. Every `MoekitError` becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import sys

import typer

from moekit.errors import MoekitError

app = typer.Typer(
    name="moekit",
    help="Count, run and fit Mixture-of-Experts language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from moekit.commands import bench, calc, corpus, eval as eval_cmd, run, train

    app.command("calc", help=calc.HELP)(calc.calc)
    app.command("run", help=run.HELP)(run.run)
    app.add_typer(bench.app, name="bench")
    app.add_typer(corpus.app, name="corpus")
    app.command("train", help=train.HELP)(train.train)
    app.command("eval", help=eval_cmd.HELP)(eval_cmd.evaluate)
    from moekit.commands import cache_sim

    app.command("cache-sim", help=cache_sim.HELP)(cache_sim.cache_sim)
    from moekit.commands import profile

    app.command("profile", help=profile.HELP)(profile.profile)
    from moekit.commands import pack

    app.command("pack", help=pack.HELP)(pack.pack)


def main() -> None:
    _register()
    try:
        app()
    except MoekitError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
