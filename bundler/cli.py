"""The `bundle` command: a thin click group. Each command parses flags, calls one library function, prints.

Commands are loaded lazily from the module that owns them, so `bundle serve` on the floor imports
nothing from the connected side. Every exit happens in `main()`: `BundleError`s become one-line
messages and the exit code of their class (see `manifests.errors.EXIT_CODES`).
"""

from __future__ import annotations

import importlib
import sys

import click

from manifests.errors import EXIT_CODES, BundleError
from runtime import settings
from runtime.signals import Terminated, exit_on_signals

# command name -> "module:attribute"; connected-side commands live in bundler, floor-side in runtime.
COMMANDS = {
    "keygen": "bundler.cli_pack:keygen",
    "create": "bundler.cli_pack:create",
    "copy": "runtime.cli:copy",
    "verify": "runtime.cli:verify",
    "inspect": "runtime.cli:inspect",
    "install": "runtime.cli:install",
    "list": "runtime.cli:list_",
    "rollback": "runtime.cli:rollback",
    "targets": "runtime.cli_targets:targets",
    "build-engines": "bundler.cli_engines:build_engines",
    "serve": "runtime.cli_serve:serve",
    "push": "runtime.cli_registry:push",
    "pull": "runtime.cli_registry:pull",
}

_EXIT_HELP = "\n".join(f"  {code:>2}  {text}" for code, text in sorted(EXIT_CODES.items()))


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExit codes:\n" + _EXIT_HELP)
@click.option("--debug", is_flag=True, help="Show tracebacks (or set BUNDLE_DEBUG=1).")
@click.version_option(package_name="bundle")
@click.pass_context
def cli(ctx, debug):
    """Signed, offline LLM bundles for NVIDIA edge devices.

    \b
    Connected host:  bundle keygen, bundle create
    Transfer:        bundle copy, bundle verify, bundle inspect, bundle push, bundle pull
    Device:          bundle install, bundle list, bundle rollback, bundle serve
    """
    ctx.obj = {"debug": debug or settings.debug()}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = settings.debug() or "--debug" in argv
    try:
        with exit_on_signals():  # SIGTERM unwinds like Ctrl-C: temporary folders are removed
            cli.main(args=argv, prog_name="bundle", standalone_mode=False)
        return 0
    except Terminated as e:
        click.echo(f"terminated (signal {e.signum})", err=True)
        return e.code
    except BundleError as e:
        if debug:
            raise
        click.echo(f"error ({e.kind}): {e}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
