"""Floor-side commands: copy, verify, inspect, install, list, rollback. Each parses flags, calls one
library function and prints; errors are raised as BundleError and mapped to exit codes in runtime.cli.main.main."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from manifests.sizes import format_size
from runtime import settings
from runtime.cli.registry import looks_like_reference, registry_flags, registry_options

_trust_option = click.option(
    "--trust", "trust", multiple=True, type=click.Path(dir_okay=False, path_type=Path), metavar="PUB",
    help="Trust this public key (repeatable). Every *.pub in the trust directory is trusted too "
         "(BUNDLE_TRUST_DIR, default /etc/bundle/trust.d).")
_unsigned_option = click.option("--allow-unsigned", is_flag=True,
                                help="Accept a bundle without a trusted signature (test bundles only).")
_jobs_option = click.option("--jobs", type=click.IntRange(min=1),
                            help="Worker threads for hashing and unpacking. Default: every core (BUNDLE_JOBS).")
_store_option = click.option("--store", type=click.Path(file_okay=False, path_type=Path),
                             default=lambda: settings.default_store(), show_default="BUNDLE_STORE or ~/.local/share/bundle/store",
                             help="Store directory of installed bundles.")


def _show_progress(no_progress: bool) -> bool:
    return not no_progress and sys.stderr.isatty()


def _warn(message: str) -> None:
    click.echo(f"bundle: warning: {message}", err=True)


def _keys(trust):
    from runtime.store.trust import trusted_keys
    return trusted_keys(list(trust), settings.trust_dir())


@click.command(epilog="""\b
Examples:
  bundle copy ./assistant-3 /media/usb/assistant-3      # onto a USB stick
  bundle copy /media/usb/assistant-3 /data/assistant-3  # off it; rerun to resume after an interruption
""")
@click.argument("src", type=click.Path(file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@_jobs_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def copy(src: Path, dst: Path, jobs, no_progress) -> None:
    """Copy bundle SRC to DST, checking every blob's sha256 as it is copied and fsyncing it.

    Blobs already complete at DST are skipped, so an interrupted copy resumes and only missing or
    damaged blobs are copied again. DST is marked COMPLETE only at the very end. SRC is never modified
    and never read through a link; nothing is written outside DST. Needs no key: run `bundle verify`
    to check the signature (copy applies the same structural checks as verify and install).
    """
    from runtime.store.copy import copy_bundle

    r = copy_bundle(src, dst, jobs=jobs, progress=_show_progress(no_progress))
    click.echo(f"copied {r.blobs_copied} blobs ({format_size(r.bytes_copied)}), skipped {r.blobs_skipped} "
               f"already complete ({format_size(r.bytes_skipped)}): {dst}")


_expiry_option = click.option(
    "--ignore-expiry", is_flag=True,
    help="Accept a bundle past its expiry (judged by the store's clock: never before the newest signed "
         "bundle it accepted).")
_dir_option = click.option("--dir", "as_dir", is_flag=True,
                           help="Take the argument as a directory even without a '/' in it.")


@click.command(epilog="""\b
Examples:
  bundle verify /media/usb/assistant-3 --trust release.pub
  bundle verify ./assistant-3 --ignore-expiry
  bundle verify assistant --store /data/store      # the installed version, file by file
\b
NAME or DIR: the argument is a directory when it contains a '/' (or is '.', or --dir is given),
otherwise the name of an installed bundle; a folder ./assistant never stands in for `assistant`.
""")
@click.argument("bundle", metavar="NAME|DIR")
@_store_option
@_dir_option
@_trust_option
@_unsigned_option
@_expiry_option
@_jobs_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def verify(bundle: str, store: Path, as_dir: bool, trust, allow_unsigned, ignore_expiry, jobs, no_progress) -> None:
    """Check a bundle directory, or an installed bundle, against its signature; then the policy.

    DIR: the signature, then every blob's size and sha256 (in parallel); every missing, truncated or
    corrupt part is listed by file and part number. NAME: the installed current version's signature
    envelope against the trusted keys, then every installed file against its signed sha256 (each
    differing file is listed). Then, for both, what install would refuse: an expired bundle is exit 5
    unless --ignore-expiry. Exit code 0 only when everything is intact, signed by a trusted key and
    not expired.
    """
    from runtime.store.store import InstalledCorruptError, Store, bundle_ref
    from runtime.store.verify import CorruptBundleError

    ref = bundle_ref(bundle, is_dir=as_dir)
    st = Store(store)
    if isinstance(ref, str):
        click.echo(f"installed bundle {ref!r} in {store} (a name: no '/' in it)", err=True)
        try:
            inst = st.verify_installed(ref, _keys(trust), allow_unsigned=allow_unsigned,
                                       ignore_expiry=ignore_expiry, jobs=jobs)
        except InstalledCorruptError as e:
            for p in e.paths:
                click.echo(f"  {p}: differs from the signed manifest", err=True)
            raise
        files = inst.manifest.files_for(inst.target)
        signers = ", ".join(inst.signers) or "none (unsigned, allowed by --allow-unsigned)"
        click.echo(f"OK installed {inst.name} v{inst.version} ({inst.target}) at {inst.path}: {len(files)} files, "
                   f"{format_size(sum(f.size for f in files))}, every sha256 matches; signed by {signers}")
        return
    try:
        vb = st.verify_dir(ref, _keys(trust), allow_unsigned=allow_unsigned, ignore_expiry=ignore_expiry,
                           jobs=jobs, progress=_show_progress(no_progress))
    except CorruptBundleError as e:
        for p in e.problems:
            click.echo(f"  {p}", err=True)
        raise
    m = vb.manifest
    signers = ", ".join(vb.signers) or "none (unsigned, allowed by --allow-unsigned)"
    click.echo(f"OK {m.name} v{m.version}: {len(m.files)} files, {len(m.blob_digests)} blobs, "
               f"{format_size(m.total_size)}; signed by {signers}")


@click.command(epilog="""\b
Examples:
  bundle inspect /media/usb/assistant-3
  bundle inspect /media/usb/assistant-3 --json | jq .targets
""")
@click.argument("bundle_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def inspect(bundle_dir: Path, as_json: bool) -> None:
    """Show models, revisions, targets, sizes, speculative settings, signer key ids and expiry.

    Needs no key and checks nothing: signer key ids are shown as claimed (unverified).
    """
    from runtime.store.inspect import format_inspect, inspect_bundle

    info = inspect_bundle(bundle_dir)
    click.echo(json.dumps(info, indent=2) if as_json else format_inspect(info))


@click.command(epilog="""\b
Examples:
  bundle install /media/usb/assistant-3 --trust release.pub
  bundle install ./assistant-3 --store /data/bundles --target jetson-thor
  bundle install ./assistant-2 --store /data/bundles --allow-downgrade
  bundle install registry.factory.lan/llm/assistant:3 --store /data/bundles --ca-file factory-ca.pem
""")
@click.argument("bundle_dir", metavar="DIR|REGISTRY/REPO:TAG")
@_store_option
@click.option("--target", default="auto", show_default=True, metavar="auto|ID",
              help="Target profile to install for; auto detects this device (see `bundle targets`).")
@_trust_option
@_unsigned_option
@click.option("--allow-downgrade", is_flag=True,
              help="Install a version below the highest one ever installed here (or replace an installed "
                   "version with a different manifest).")
@click.option("--force-target", is_flag=True,
              help="Install for --target ID even when this machine is not one (a store prepared for another "
                   "device); without it a mismatch is exit 6.")
@_expiry_option
@_jobs_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@registry_flags()
def install(bundle_dir: str, store: Path, target, force_target, trust, allow_unsigned, allow_downgrade,
            ignore_expiry, jobs, no_progress, **registry) -> None:
    """Verify and install a bundle into the store, then make it current.

    The signature is checked before any blob is read, then the policy decides (target, version,
    expiry, reserved paths, space); only the files the target needs are unpacked, each checked
    against its signed sha256, in a staging directory; then `current` switches atomically and the
    previous version is kept for `bundle rollback`.

    \b
    Versions: the store records the highest signed version ever installed per name (state.json);
    a lower one is refused unless --allow-downgrade, even after `current` was removed.
    Expiry: refused unless --ignore-expiry; the store's clock never goes back before the newest
    signed bundle it accepted (unsigned bundles do not move it).
    Repair: re-installing the installed version re-checks every installed file's sha256; when all
    match it is a no-op, otherwise the bad files (or damaged install.json/manifest.json, or a
    missing `current` link) are repaired from the bundle and the good ones kept.
    Registry: DIR may be REGISTRY/REPO:TAG; the bundle is pulled into STORE/registry-cache/ (kept:
    the next version fetches only its new blobs), then installed from there with every check above.
    Target: --target ID must be what this machine is (as auto detects it; cpu fits any machine),
    else exit 6 unless --force-target. Ctrl-C/SIGTERM: before the commit nothing stays changed
    (exit 130/143); from the commit on the install finishes and exits 0.
    """
    from runtime.detect import check_target, detect_target
    from runtime.signals import finish
    from runtime.store.store import Store

    if target == "auto":
        target, reason = detect_target()
        click.echo(f"target: {target} ({reason})")
    elif warning := check_target(target, force=force_target):
        _warn(warning)
    args = dict(target=target, trusted=_keys(trust), allow_unsigned=allow_unsigned, allow_downgrade=allow_downgrade,
                ignore_expiry=ignore_expiry, jobs=jobs, progress=_show_progress(no_progress))
    if looks_like_reference(bundle_dir):
        from runtime.store.registry import install_from_registry

        pulled, inst = install_from_registry(bundle_dir, store, options=registry_options(**registry),
                                             quiet=not _show_progress(no_progress), **args)
        click.echo(f"pulled {pulled.ref}@{pulled.digest}: fetched {pulled.blobs_fetched} blobs "
                   f"({format_size(pulled.bytes_fetched)}), reused {pulled.blobs_reused}; signature "
                   f"{pulled.signature}")
    else:
        inst = finish(lambda: Store(store).install(Path(bundle_dir), **args), "install", _warn)
    verb = "already installed (every file checked)" if inst.noop else "installed"
    if inst.repaired:
        verb = f"repaired ({inst.repaired})"
    prev = f"; previous v{inst.previous_version} kept for rollback" if inst.previous_version else ""
    click.echo(f"{verb} {inst.name} v{inst.version} for {inst.target} at {inst.path}{prev}")


@click.command(epilog="""\b
Examples:
  bundle list
  bundle list --store /data/bundles --json
""")
@_store_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_(store: Path, as_json: bool) -> None:
    """Show installed bundles: name, version, target, install time, and the version rollback returns to.

    A bundle whose current version is damaged is listed as DAMAGED with the reason (`bundle install`
    of a good copy repairs it).
    """
    from runtime.store.store import Store

    from runtime.store.store import Damaged

    items = Store(store).entries()
    if as_json:
        click.echo(json.dumps([{"name": i.name, "version": i.version, "damaged": i.reason,
                                "path": str(i.path) if i.path else None} if isinstance(i, Damaged) else
                               {"name": i.name, "version": i.version, "target": i.target, "path": str(i.path),
                                "installed_at": i.installed_at, "previous_version": i.previous_version,
                                "signers": list(i.signers)} for i in items], indent=2))
        return
    if not items:
        click.echo(f"no bundles installed in {store}")
        return
    click.echo(f"{'NAME':<24} {'VERSION':>7}  {'TARGET':<16} {'INSTALLED':<20}  PREVIOUS")
    for i in items:
        if isinstance(i, Damaged):
            click.echo(f"{i.name:<24} {'v' + str(i.version):>7}  DAMAGED: {i.reason}")
            continue
        prev = f"v{i.previous_version}" if i.previous_version else "-"
        click.echo(f"{i.name:<24} {'v' + str(i.version):>7}  {i.target:<16} {i.installed_at:<20}  {prev}")


list_.name = "list"


@click.command(epilog="""\b
Examples:
  bundle rollback assistant
  bundle rollback assistant --store /data/bundles
""")
@click.argument("name")
@_store_option
@_expiry_option
def rollback(name: str, store: Path, ignore_expiry: bool) -> None:
    """Make the previous installed version of NAME current again (running it again rolls forward).

    The same policy as install and serve: an expired previous version is refused unless
    --ignore-expiry. Rolling back is the one way down that needs no --allow-downgrade.
    """
    from runtime.signals import finish
    from runtime.store.store import Store

    inst = finish(lambda: Store(store).rollback(name, ignore_expiry=ignore_expiry), "rollback", _warn)
    click.echo(f"rolled back {inst.name} to v{inst.version} ({inst.target}); "
               f"v{inst.previous_version} kept as previous")
