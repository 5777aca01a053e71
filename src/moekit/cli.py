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
    context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit both
)


def _print_version(value: bool) -> None:
    if value:
        from moekit import __version__

        typer.echo(f"moekit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print moekit's version and exit."
    ),
) -> None:
    """Count, run and fit Mixture-of-Experts language models."""


def _register() -> None:
    if app.registered_commands:  # once: main() runs many times in one process (the CLI tests)
        return
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
    from moekit.commands import checksum

    app.command("checksum", help=checksum.HELP)(checksum.checksum)
    from moekit.commands import placement, simulate

    app.command("placement", help=placement.HELP)(placement.placement)
    app.command("simulate", help=simulate.HELP)(simulate.simulate)
    from moekit.commands import bench_serve, serve

    app.command("serve", help=serve.HELP)(serve.serve)
    from moekit.commands import analyze, eval_routing, report

    app.command("analyze", help=analyze.HELP)(analyze.analyze)
    app.command("report", help=report.HELP)(report.report)
    app.command("eval-routing", help=eval_routing.HELP)(eval_routing.eval_routing)
    bench.app.command("serve", help=bench_serve.HELP)(bench_serve.serve)
    from moekit.commands import bench_checkpoint

    bench.app.command("make-checkpoint", help=bench_checkpoint.HELP)(bench_checkpoint.make_checkpoint)
    from moekit.commands import ops

    app.add_typer(ops.app, name="ops")


def main() -> None:
    _register()
    from moekit.commands.help_text import readable

    command = typer.main.get_command(app)
    readable(command)
    from moekit.dist.cli import bare_flag

    bare = bare_flag(sys.argv[1:])
    if bare is not None:
        typer.echo(f"error: {bare}", err=True)
        sys.exit(2)
    try:
        command(prog_name="moekit")
    except MoekitError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
