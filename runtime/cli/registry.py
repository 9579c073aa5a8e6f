"""`bundle push` and `bundle pull`: a bundle to and from an OCI registry (on-prem Harbor, distribution).

Each parses flags, calls one function of runtime.store.registry and prints; the registry client (skopeo) is
reached only from here and from `bundle install REGISTRY/REPO:TAG`, never from `bundle serve`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from manifests.sizes import format_size

ca_file_option = click.option(
    "--ca-file", type=click.Path(dir_okay=False, path_type=Path), metavar="PEM",
    help="Trust this CA for the registry's TLS certificate, besides the system's (instead of "
         "/etc/containers/certs.d/HOST:PORT/).")
authfile_option = click.option(
    "--authfile", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
    help="Registry credentials (Podman auth.json or Docker config.json format). Default: REGISTRY_AUTH_FILE, "
         "$XDG_RUNTIME_DIR/containers/auth.json, ~/.docker/config.json (`podman login` / `docker login`).")


def _seconds(name: str, default: float, help: str):
    return click.option(name, type=click.FloatRange(min=0, min_open=True), default=default, show_default=True,
                        metavar="SECONDS", help=help)


def registry_flags(*, pull: bool = True):
    """Every registry flag of push, pull and install REF (one place: they stay alike)."""
    from runtime.store.registry_options import Timeouts

    t = Timeouts()
    options = [
        ca_file_option, authfile_option,
        click.option("--allow-token-realm", "allow_token_realm", multiple=True, metavar="HOST",
                     help="Let the registry's token realm on HOST (or HOST:PORT) get its credentials; by default "
                          "a realm on another host than the registry's is refused. Repeatable."),
        _seconds("--connect-timeout", t.connect, "Give up when the registry does not accept a connection in this "
                                                  "long (exit 10)."),
        _seconds("--idle-timeout", t.idle, "Give up when less than 1 KiB moves in this long: a registry that stops "
                                           "answering or trickles (exit 10)."),
        _seconds("--total-timeout", t.total, "Give up when the whole transfer takes longer (exit 10)."),
    ]
    if pull:
        options.append(_seconds("--lock-timeout", t.pull_lock, "Wait at most this long for another pull or "
                                                               "install into the same directory (exit 6)."))

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


def looks_like_reference(text: str) -> bool:
    """True for `host[:port]/repo...` (Docker's rule: the first part names a host when it has '.' or ':'
    or is localhost) that is not an existing local path; `docker://` forces it."""
    if text.startswith("docker://"):
        return True
    if text.startswith(("/", "./", "../", "~")) or Path(text).exists():
        return False
    first = text.split("/", 1)[0]
    return "/" in text and ("." in first or ":" in first or first == "localhost")


def registry_options(ca_file=None, authfile=None, allow_token_realm=(), connect_timeout=None, idle_timeout=None,
                     total_timeout=None, lock_timeout=None):
    """The values of `registry_flags` as RegistryOptions (a flag left out keeps its default)."""
    from runtime.store.registry_options import RegistryOptions, Timeouts

    given = {"connect": connect_timeout, "idle": idle_timeout, "total": total_timeout, "pull_lock": lock_timeout}
    return RegistryOptions(ca_file=ca_file, authfile=authfile, allow_token_realms=tuple(allow_token_realm),
                           timeouts=Timeouts(**{k: v for k, v in given.items() if v is not None}))


def _quiet(no_progress: bool) -> bool:
    return no_progress or not sys.stderr.isatty()


@click.command(epilog="""\b
Examples:
  bundle push ./assistant-3 registry.factory.lan/llm/assistant          # tag: the bundle's version (3)
  bundle push ./assistant-3 registry.factory.lan:5000/llm/assistant:stable --ca-file factory-ca.pem
""")
@click.argument("bundle_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.argument("target", metavar="REGISTRY/REPO[:TAG]")
@registry_flags(pull=False)
@click.option("--no-progress", is_flag=True, help="No progress output.")
def push(bundle_dir: Path, target: str, no_progress, **registry) -> None:
    """Push bundle DIR to an OCI registry, uploading only the blobs the registry lacks.

    Every blob is checked first (a damaged bundle is never published). The bundle travels unchanged:
    the registry serves the same manifest digest, with the signature envelope as one of its layers.
    Needs no key.
    """
    from runtime.store.registry import push as push_bundle

    r = push_bundle(bundle_dir, target, options=registry_options(**registry), quiet=_quiet(no_progress))
    click.echo(f"pushed {r.name} v{r.version} ({r.blobs} blobs, {format_size(r.size)}) to {r.ref}@{r.digest}")


@click.command(epilog="""\b
Examples:
  bundle pull registry.factory.lan/llm/assistant:3 /data/pull/assistant
  bundle pull registry.factory.lan/llm/assistant@sha256:4f1c... ./assistant --ca-file factory-ca.pem
""")
@click.argument("source", metavar="REGISTRY/REPO[:TAG|@DIGEST]")
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@registry_flags()
@click.option("--no-progress", is_flag=True, help="No progress output.")
def pull(source: str, dest: Path, no_progress, **registry) -> None:
    """Pull a bundle from an OCI registry into DIR, fetching only the blobs DIR lacks.

    DIR may hold an earlier version or an interrupted pull: its intact blobs are reused, so a rerun
    resumes and a new version fetches only what changed. DIR is marked COMPLETE only at the end, and
    then verifies and installs exactly as a copied bundle. Needs no key: run `bundle verify` next.
    """
    from runtime.store.registry import pull as pull_bundle

    r = pull_bundle(source, dest, options=registry_options(**registry), quiet=_quiet(no_progress))
    click.echo(f"pulled {r.name} v{r.version} ({r.digest}): fetched {r.blobs_fetched} blobs "
               f"({format_size(r.bytes_fetched)}), reused {r.blobs_reused} ({format_size(r.bytes_reused)}): {dest}")
