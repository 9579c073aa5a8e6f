"""`bundle targets`: the target profiles as a table, and (with --detect) which one this machine is."""

from __future__ import annotations

import json

import click

from manifests.sizes import format_size
from manifests.targets import TargetProfile
from runtime.profiles import all_profiles

COLUMNS = ("id", "arch", "gpu", "memory", "precisions", "cuda", "tensorrt", "backend")


def profile_rows(profiles: list[TargetProfile]) -> list[tuple[str, ...]]:
    return [(p.id, p.cpu_arch, f"sm_{p.compute_capability.replace('.', '')}" if p.compute_capability else "-",
             format_size(p.memory_bytes), ",".join(p.precisions), p.cuda_version or "-",
             p.tensorrt_version or "-", p.backend) for p in profiles]


def format_table(rows: list[tuple[str, ...]], header: tuple[str, ...] = COLUMNS) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


@click.command("targets")
@click.option("--detect", is_flag=True, help="Also say which target this machine is, and why.")
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
@click.option("--profile-dir", "profile_dirs", multiple=True, type=click.Path(file_okay=False),
              help="Extra directory of profile *.json files (also BUNDLE_PROFILE_DIR).")
def targets(detect, as_json, profile_dirs):
    """List the target profiles a bundle can be made for.

    A profile file (JSON, same fields as `--json` prints) in BUNDLE_PROFILE_DIR or
    --profile-dir adds a device kind, or replaces a built-in profile of the same id.

    \b
    Example:
      bundle targets --detect
    """
    profiles = all_profiles(profile_dirs)
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in profiles], indent=2))
    else:
        click.echo(format_table(profile_rows(profiles)))
    if detect:
        from runtime.engines.cudalib import gpu
        from runtime.detect import detect_target, tensorrt_bindings

        target_id, reason = detect_target(profiles)
        found = gpu()
        if found is not None:  # what the cuda profile leaves to the device: its compute capability and memory
            click.echo(f"\ngpu: {found.name}, compute capability {found.compute_capability}, "
                       f"{format_size(found.memory_bytes)}")
        click.echo(f"\ndetected: {target_id} ({reason})")
        click.echo(f"tensorrt: {tensorrt_bindings()}")
