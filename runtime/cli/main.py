"""The `bundle` command: a thin click group. Each command parses flags, calls one library function, prints.

The entry point lives on the floor side (the `bundle-runtime` distribution), so a device runs no
build-host code. The floor commands are listed here; the build-host commands (keygen, create,
build-engines) are discovered through the `bundle.commands` entry-point group, which only the full
`bundle` distribution registers. Commands load lazily from the module that owns them, so `bundle serve`
imports nothing it does not need. Every exit happens in `main()`: `BundleError`s become one-line
messages and the exit code of their class (see `manifests.errors.EXIT_CODES`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import traceback

import click

from manifests.errors import EXIT_CODES, BundleError, EnvironmentProblem, printable
from runtime import settings
from runtime.signals import Terminated, exit_on_signals

#: floor command name -> "module:attribute"
FLOOR_COMMANDS = {
    "copy": "runtime.cli.floor:copy",
    "verify": "runtime.cli.floor:verify",
    "inspect": "runtime.cli.floor:inspect",
    "install": "runtime.cli.floor:install",
    "list": "runtime.cli.floor:list_",
    "rollback": "runtime.cli.floor:rollback",
    "targets": "runtime.cli.targets:targets",
    "serve": "runtime.cli.serve:serve",
    "push": "runtime.cli.registry:push",
    "pull": "runtime.cli.registry:pull",
}
#: entry-point group through which the full package adds its commands
ENTRY_POINT_GROUP = "bundle.commands"
#: what the full package adds, named so a floor-only install can say where they live
BUILD_HOST_COMMANDS = ("keygen", "create", "build-engines")
FLOOR_DISTRIBUTION = "bundle-runtime"
FULL_DISTRIBUTION = "bundle"

#: a missing third-party module -> what to install for it. Anything not listed is a broken floor install.
_BUILD_MODULES = {"torch", "transformers", "huggingface_hub", "onnx", "safetensors", "bundler"}

_EXIT_HELP = "\n".join(f"  {code:>2}  {text}" for code, text in sorted(EXIT_CODES.items()))


def plugin_commands() -> dict[str, importlib.metadata.EntryPoint]:
    """Commands other installed distributions register in the `bundle.commands` group (floor names win)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            if ep.name not in FLOOR_COMMANDS}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(FLOOR_COMMANDS) + sorted(plugin_commands())

    def get_command(self, ctx, name):
        target = FLOOR_COMMANDS.get(name)
        if target is not None:
            module, _, attr = target.partition(":")
            return getattr(importlib.import_module(module), attr)
        ep = plugin_commands().get(name)
        if ep is not None:
            return ep.load()
        if name in BUILD_HOST_COMMANDS:
            raise EnvironmentProblem(
                f"`bundle {name}` is a build-host command: expected the full {FULL_DISTRIBUTION!r} package, found "
                f"only the floor runtime ({FLOOR_DISTRIBUTION}); on the connected build host run "
                f"pip install '{FULL_DISTRIBUTION}[build]'")
        return None


def _version() -> str:
    try:
        return importlib.metadata.version(FLOOR_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExit codes:\n" + _EXIT_HELP)
@click.option("--debug", is_flag=True, help="Show tracebacks (or set BUNDLE_DEBUG=1); exit codes stay the same.")
@click.version_option(version=_version(), prog_name="bundle")
@click.pass_context
def cli(ctx, debug):
    """Signed, offline LLM bundles for NVIDIA edge devices.

    \b
    Connected host:  bundle keygen, bundle create, bundle build-engines (the full package)
    Transfer:        bundle copy, bundle verify, bundle inspect, bundle push, bundle pull
    Device:          bundle install, bundle list, bundle rollback, bundle serve
    """
    ctx.obj = {"debug": debug or settings.debug()}


def missing_module_error(e: ModuleNotFoundError) -> EnvironmentProblem:
    """Name the package that provides a module this install lacks (exit 6, not a traceback)."""
    top = (e.name or "").split(".")[0] or "unknown"
    if top in _BUILD_MODULES:
        fix = (f"it belongs to the build host: pip install '{FULL_DISTRIBUTION}[build]' "
               f"(the floor runtime {FLOOR_DISTRIBUTION} does not carry it)")
    else:
        fix = f"this install is incomplete: reinstall {FLOOR_DISTRIBUTION} with its dependencies"
    return EnvironmentProblem(f"expected the Python module {top!r}, found it missing; {fix}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = settings.debug() or "--debug" in argv

    def report(e: BundleError) -> int:
        if debug:
            traceback.print_exc()
        click.echo(printable(f"error ({e.kind}): {e}", keep_newlines=True), err=True)  # remote text in it
        return e.exit_code

    try:
        with exit_on_signals():  # SIGTERM unwinds like Ctrl-C: temporary folders are removed
            cli.main(args=argv, prog_name="bundle", standalone_mode=False)
        return 0
    except Terminated as e:
        click.echo(f"terminated (signal {e.signum})", err=True)
        return e.code
    except BundleError as e:
        return report(e)
    except ModuleNotFoundError as e:
        return report(missing_module_error(e))
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
    except Exception as e:  # noqa: BLE001 - the one place every unexpected error becomes exit 1
        if debug:
            traceback.print_exc()
        click.echo(printable(f"error (internal): {type(e).__name__}: {e} (rerun with --debug for the traceback, "
                             f"and report it)", keep_newlines=True), err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
