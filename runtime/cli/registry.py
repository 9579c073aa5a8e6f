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
    help="Trust this CA for the registry's TLS certificate (besides the system's and "
         "/etc/containers/certs.d/HOST/).")
authfile_option = click.option(
    "--authfile", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
    help="Registry credentials (Podman auth.json or Docker config.json format). Default: REGISTRY_AUTH_FILE, "
         "$XDG_RUNTIME_DIR/containers/auth.json, ~/.docker/config.json (`podman login` / `docker login`).")


def looks_like_reference(text: str) -> bool:
    """True for `host[:port]/repo...` (Docker's rule: the first part names a host when it has '.' or ':'
    or is localhost) that is not an existing local path; `docker://` forces it."""
    if text.startswith("docker://"):
        return True
    if text.startswith(("/", "./", "../", "~")) or Path(text).exists():
        return False
    first = text.split("/", 1)[0]
    return "/" in text and ("." in first or ":" in first or first == "localhost")


def registry_options(ca_file, authfile):
    from runtime.store.skopeo import RegistryOptions

    return RegistryOptions(ca_file=ca_file, authfile=authfile)


def _quiet(no_progress: bool) -> bool:
    return no_progress or not sys.stderr.isatty()


@click.command(epilog="""\b
Examples:
  bundle push ./assistant-3 registry.factory.lan/llm/assistant          # tag: the bundle's version (3)
  bundle push ./assistant-3 registry.factory.lan:5000/llm/assistant:stable --ca-file factory-ca.pem
""")
@click.argument("bundle_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.argument("target", metavar="REGISTRY/REPO[:TAG]")
@ca_file_option
@authfile_option
@click.option("--no-progress", is_flag=True, help="No progress output.")
def push(bundle_dir: Path, target: str, ca_file, authfile, no_progress) -> None:
    """Push bundle DIR to an OCI registry, uploading only the blobs the registry lacks.

    Every blob is checked first (a damaged bundle is never published). The bundle travels unchanged:
    the registry serves the same manifest digest, with the signature envelope as one of its layers.
    Needs no key.
    """
    from runtime.store.registry import push as push_bundle

    r = push_bundle(bundle_dir, target, options=registry_options(ca_file, authfile), quiet=_quiet(no_progress))
    click.echo(f"pushed {r.name} v{r.version} ({r.blobs} blobs, {format_size(r.size)}) to {r.ref}@{r.digest}")


@click.command(epilog="""\b
Examples:
  bundle pull registry.factory.lan/llm/assistant:3 /data/pull/assistant
  bundle pull registry.factory.lan/llm/assistant@sha256:4f1c... ./assistant --ca-file factory-ca.pem
""")
@click.argument("source", metavar="REGISTRY/REPO[:TAG|@DIGEST]")
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@ca_file_option
@authfile_option
@click.option("--no-progress", is_flag=True, help="No progress output.")
def pull(source: str, dest: Path, ca_file, authfile, no_progress) -> None:
    """Pull a bundle from an OCI registry into DIR, fetching only the blobs DIR lacks.

    DIR may hold an earlier version or an interrupted pull: its intact blobs are reused, so a rerun
    resumes and a new version fetches only what changed. DIR is marked COMPLETE only at the end, and
    then verifies and installs exactly as a copied bundle. Needs no key: run `bundle verify` next.
    """
    from runtime.store.registry import pull as pull_bundle

    r = pull_bundle(source, dest, options=registry_options(ca_file, authfile), quiet=_quiet(no_progress))
    click.echo(f"pulled {r.name} v{r.version} ({r.digest}): fetched {r.blobs_fetched} blobs "
               f"({format_size(r.bytes_fetched)}), reused {r.blobs_reused} ({format_size(r.bytes_reused)}): {dest}")
