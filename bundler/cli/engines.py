"""`bundle build-engines`: parse flags, call bundler.pack.engines.build_engines_bundle, print the result.

It lives on the bundler side because it packs and signs a new bundle version.
"""

from __future__ import annotations

from pathlib import Path

import click

from manifests.errors import UsageError
from runtime import settings
@click.command("build-engines", epilog="""\b
Example (on a lab Jetson Thor with the fleet's JetPack):
  bundle build-engines assistant-3 --target jetson-thor --sign-key keys/lab.key \\
      --trust keys/release.key.pub --out assistant-4
""")
@click.argument("bundle_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--target", "target_id", required=True, help="Target id whose engines to build (this device's kind).")
@click.option("--sign-key", "sign_key_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Private key that signs the new version (repeatable).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the new bundle version (the input's version + 1).")
@click.option("--trust", "trust_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Public key trusted to have signed BUNDLE_DIR (in addition to the trust directory).")
@click.option("--allow-unsigned", is_flag=True, help="Accept an unsigned input bundle (tests only).")
def build_engines(bundle_dir, target_id, sign_key_paths, out, trust_paths, allow_unsigned):
    """Build the TensorRT engines of BUNDLE_DIR for this device and pack them as a new signed version.

    Run it once on one device of a kind (same GPU and TensorRT version as the fleet); the rest of
    the fleet installs the new version and skips the first-start build. The ONNX stays in the
    bundle, so devices whose TensorRT differs still build their own.
    """
    from bundler.pack.engines import build_engines_bundle
    from bundler.pack.keys import load_private_key
    from runtime.store.trust import trusted_keys

    if not sign_key_paths:
        raise UsageError("expected at least one --sign-key KEY, found none")
    passphrase = settings.key_passphrase()
    keys = [load_private_key(p, passphrase) for p in sign_key_paths]
    trusted = trusted_keys(list(trust_paths))
    manifest = build_engines_bundle(bundle_dir, target_id, out, sign_keys=keys, trusted=trusted,
                                    allow_unsigned=allow_unsigned)
    plans = [e.path for t in manifest.targets if t.id == target_id for e in t.engines if e.format == "tensorrt-plan"]
    click.echo(f"wrote {out}: {manifest.name} v{manifest.version} with {len(plans)} engine(s) for {target_id}")
