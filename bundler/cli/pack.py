"""`bundle keygen` and `bundle create`: parse flags, call one library function, print the result."""

from __future__ import annotations

from pathlib import Path

import click

from bundler.cli.quant import create_quantization, quality_lines, quantization_options
from manifests.errors import UsageError
from manifests.sizes import format_size, parse_size
from runtime import settings
from manifests.limits import LIMITS
def _passphrase_from_env() -> bytes | None:
    return settings.key_passphrase()


@click.command(epilog="""\b
Examples:
  bundle keygen keys/release.key
  bundle keygen keys/release.key --passphrase      # prompts twice
  BUNDLE_KEY_PASSPHRASE=... bundle keygen k --passphrase   # unattended
""")
@click.argument("key", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--passphrase", is_flag=True,
              help="Encrypt the private key with a passphrase: prompted for (twice), or taken from "
                   "BUNDLE_KEY_PASSPHRASE when set. Without this flag the key is not encrypted and nothing prompts.")
@click.option("--force", is_flag=True, help="Overwrite KEY and KEY.pub if they exist.")
def keygen(key: Path, passphrase: bool, force: bool) -> None:
    """Create an Ed25519 signing key: KEY (private, mode 0600) and KEY.pub (public, give it to devices).

    Prints the key id: sha256 of the raw public key, as it appears in bundle signatures.
    """
    from bundler.pack.keys import generate_key, public_key_path

    secret = None
    if passphrase:
        secret = _passphrase_from_env()
        if secret is None:
            secret = click.prompt("Passphrase", hide_input=True, confirmation_prompt=True, err=True).encode()
            if not secret:
                raise UsageError("expected a non-empty passphrase, found an empty one")
    kid = generate_key(key, secret, force=force)
    click.echo(f"private key: {key}")
    click.echo(f"public key:  {public_key_path(key)}")
    click.echo(f"key id:      {kid}")


def read_serve_defaults(path: Path | None, args: tuple[str, ...], max_model_len: int | None) -> dict:
    """--serve-config FILE, then --serve-arg flags, then --max-model-len: one config, checked as bundle serve
    will check it (a refused flag fails the create, not the device)."""
    from manifests import serve_config, strict_json

    config: dict = {}
    if path is not None:
        if path.stat().st_size > LIMITS.serve_arg_chars:
            raise UsageError(f"--serve-config {path}: expected at most {LIMITS.serve_arg_chars} bytes")
        data = strict_json.parse(path.read_bytes(), what=f"--serve-config {path}",
                                 max_bytes=LIMITS.serve_arg_chars, error=UsageError)
        config, unknown = serve_config.parse_config(data, source=f"--serve-config {path}")
        if unknown:
            raise UsageError(f"--serve-config {path}: unknown keys {sorted(unknown)}; expected vLLM argument "
                             f"names such as tool_call_parser, max_model_len")
    config = serve_config.merge(config, serve_config.parse_args(args))
    if max_model_len:
        config["max_model_len"] = max_model_len
    serve_config.check(config)
    return config


def runtime_platforms(with_runtime: str | None, no_runtime: bool, targets: list[str]) -> list[str]:
    """--with-runtime / --no-runtime / the targets' default, as a list of platforms ([] = no wheelhouse)."""
    from bundler.pack.wheelhouse import default_platforms, parse_platforms

    if with_runtime is not None and no_runtime:
        raise UsageError("expected either --with-runtime or --no-runtime, found both")
    if no_runtime:
        return []
    return parse_platforms(with_runtime) if with_runtime is not None else default_platforms(targets)


def _rtx_builder(targets):
    """The TensorRT-RTX builder for --rtx-engines; one line per target it cannot build for, and why."""
    from bundler.pack.aot import RtxBuilder
    from runtime.profiles import get_profile

    aot = RtxBuilder()
    for t in targets:
        profile = get_profile(t)
        if profile.backend == "tensorrt" and aot.compute_capability_for(profile) is None:
            click.echo(f"rtx:      {t}: TensorRT-RTX {aot.version[4:]} builds for sm_"
                       f"{', sm_'.join(c.replace('.', '') for c in aot.targets)}, not sm_"
                       f"{profile.compute_capability.replace('.', '')}: its plan is built on the device", err=True)
    return aot


@click.command(epilog="""\b
Examples:
  bundle create --model ./llama-1b --draft ./llama-draft --targets jetson-thor,igx-thor \\
      --name assistant --version 3 --sign-key keys/release.key --out /media/usb/assistant-3
  bundle create --targets cpu --name demo --version 1 --unsigned      # the embedded demo pair
  bundle create --targets cpu --name demo --version 2 --unsigned \\
      --serve-arg '--enable-auto-tool-choice --tool-call-parser hermes --served-model-name assistant'
  bundle create --targets jetson-thor --with-runtime linux_aarch64-cp312 --extra-wheels ./site-wheels \
      --name assistant --version 3 --sign-key keys/release.key      # devices install the runtime from it
""")
@click.option("--model", "model_ref", metavar="REPO[@REV]|DIR",
              help="Target model: a Hugging Face repo (org/name, optionally @branch, @tag or @commit; pinned to "
                   "its commit sha), or a Hugging Face-format folder. Default: the embedded demo pair.")
@click.option("--draft", "draft_ref", metavar="REPO[@REV]|DIR",
              help="Draft model for speculative decoding (must share the target's tokenizer vocabulary).")
@click.option("--speculative-config", "spec_config", metavar="JSON",
              help="vLLM-style speculative config, instead of --draft/--num-speculative-tokens: "
                   "'{\"method\": \"draft_model\", \"model\": \"org/draft\", \"num_speculative_tokens\": 3}', or "
                   "'{\"method\": \"eagle3\", \"model\": \"HEAD_DIR\"}' for an EAGLE-3 head (no model: the demo's).")
@click.option("--include", multiple=True, metavar="GLOB", help="Also bundle model files matching GLOB (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave out model files matching GLOB (repeatable).")
@click.option("--lock", "lock_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Rebuild exactly what a lock file records (refuse if anything resolved differs). "
                   "Without --lock, create writes OUT.lock.json next to the bundle.")
@click.option("--max-model-len", type=click.IntRange(min=16), metavar="N",
              help="Serve context length: sizes the engines and the memory check. Default: the model's, capped at 4096.")
@click.option("--targets", "targets_text", required=True, metavar="IDS",
              help="Comma-separated target profile ids, e.g. jetson-thor,igx-thor (see `bundle targets`).")
@click.option("--name", required=True, help="Bundle name: lowercase letters, digits, '.', '_', '-'.")
@click.option("--version", "version", required=True, type=click.IntRange(min=1),
              help="Bundle version, an integer that must increase with every release (devices refuse downgrades).")
@click.option("--sign-key", "sign_key_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              metavar="KEY", help="Private key to sign with (repeat for several signatures). "
                                  "Encrypted keys read their passphrase from BUNDLE_KEY_PASSPHRASE.")
@click.option("--unsigned", is_flag=True, help="Make an unsigned bundle (devices refuse it without --allow-unsigned).")
@click.option("--max-part-size", default="3.9G", show_default=True, metavar="SIZE",
              help="No file in the bundle exceeds this size (FAT32 holds < 4 GiB). Accepts 512K, 1M, 3.9G. "
                   "Wheels are stored whole: a larger one is refused.")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Bundle directory to write. Default: ./NAME-VERSION. Rerun the same command to resume.")
@click.option("--expires", metavar="DATE|Nd", help="Devices refuse the bundle after this: 2027-06-01, or 90d from now.")
@click.option("--num-speculative-tokens", default=3, show_default=True, type=click.IntRange(1, 16),
              help="Draft tokens proposed per step (with --draft).")
@click.option("--serve-arg", "serve_args", multiple=True, metavar="FLAGS",
              help="vllm serve flags the bundle carries as its serve defaults (repeatable; quote a group): "
                   "--serve-arg '--tool-call-parser hermes --enable-auto-tool-choice' --serve-arg --max-model-len=4k. "
                   "A device then needs only `bundle serve NAME`; its command line still wins.")
@click.option("--serve-config", "serve_config_path", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              metavar="FILE", help="JSON object of serve defaults keyed by vLLM's argument names "
                                   "({\"tool_call_parser\": \"hermes\"}); --serve-arg values win over it.")
@click.option("--with-checkpoint-weights/--no-checkpoint-weights", "with_checkpoint_weights", default=False,
              help="Also carry the checkpoint's weight files that no target installs (every target's engine has "
                   "its own weights), for a site that re-exports on the device; about doubles the bundle. Default "
                   "(--no-checkpoint-weights): left out, each listed with size and sha256 in the signed manifest.")
@click.option("--with-runtime", "with_runtime", metavar="PLATFORM[,PLATFORM...]",
              help="Put the floor runtime (bundle-runtime and every dependency, as wheels) and the bootstrap into "
                   "the bundle for these platforms: linux_aarch64-cp312 (JetPack 7, DGX Spark), linux_x86_64-cp311, "
                   "linux_x86_64-cp312, ... Default: the targets' platforms (jetson-thor: linux_aarch64-cp312; "
                   "cpu: this host's; cuda names none: give --with-runtime or --no-runtime).")
@click.option("--no-runtime", "no_runtime", is_flag=True,
              help="Leave the runtime wheelhouse and the bootstrap out (devices that have the runtime installed).")
@click.option("--extra-wheels", "extra_wheels", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Also carry the wheels in DIR (e.g. TensorRT Python bindings, an onnxruntime-gpu for JetPack), "
                   "each for the platforms its tags fit; a bundle_runtime-*.whl there is used as the floor wheel.")
@click.option("--wheel-cache", "wheel_cache", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Where downloaded wheels are kept between runs (a warm cache needs no index). "
                   "Default: BUNDLE_CACHE_DIR/wheels (~/.cache/bundle/wheels).")
@click.option("--force", is_flag=True,
              help="Replace a finished bundle already at --out, and build even if a model does not fit a "
                   "target's memory (a warning instead of a refusal).")
@click.option("--allow-no-chat-template", is_flag=True,
              help="Bundle a target with no chat template (a warning instead of a refusal, exit 8): the device "
                   "then serves /v1/completions only.")
@click.option("--rtx-engines", "rtx_engines", is_flag=True,
              help="Build TensorRT-RTX plans here, ahead of time and with no GPU, for every TensorRT target whose "
                   "GPU TensorRT-RTX targets (dgx-spark, sm_121; not the Thors or Orins): the device loads the "
                   "plan when its key matches (TensorRT-RTX of that version) and builds its own otherwise. "
                   "Needs bundle[rtx].")
@click.option("--jobs", type=click.IntRange(min=1), help="Compression threads. Default: every core (BUNDLE_JOBS).")
@click.option("--no-progress", is_flag=True,
              help="No progress: neither the bars (on a terminal) nor the timestamped lines on stderr (otherwise).")
@quantization_options
def create(model_ref, draft_ref, spec_config, include, exclude, lock_path, max_model_len, targets_text, name,
           version, sign_key_paths, unsigned, max_part_size, out, expires, num_speculative_tokens,
           serve_args, serve_config_path, with_checkpoint_weights, with_runtime, no_runtime, extra_wheels,
           wheel_cache, force, allow_no_chat_template, rtx_engines, jobs, no_progress, quantization) -> None:
    """Pack a model (and draft) into a signed, zstd-compressed bundle directory (an OCI image layout).

    Every file is recorded in a signed manifest with its sha256; files larger than --max-part-size are
    split so the bundle fits on FAT32 USB sticks. An interrupted create resumes when run again.
    """
    from bundler.pack.create import CreateOptions, checked_resolution, create_bundle, resolve_inputs
    from bundler.pack.engines import target_files_hook
    from bundler.pack.keys import load_private_key
    from bundler.resolve.lockfile import write_lock
    from bundler.pack.progress import lines_wanted, progress_lines
    from runtime.profiles import parse_targets

    click.get_current_context().with_resource(progress_lines(lines_wanted(not no_progress)))
    targets = parse_targets(targets_text)
    quantization, quant_record = create_quantization(quantization, targets, lock_path)
    part_size = parse_size(max_part_size)
    serve = read_serve_defaults(serve_config_path, serve_args, max_model_len)
    max_model_len = serve.get("max_model_len")
    method = "draft_model"
    platforms = runtime_platforms(with_runtime, no_runtime, targets)
    aot = _rtx_builder(targets) if rtx_engines else None
    if platforms:
        from bundler.pack.wheelhouse import onnxruntime_gpu_lines

        for line in onnxruntime_gpu_lines(targets, platforms, extra_wheels):
            click.echo(line, err=True)
    if spec_config is not None:
        from manifests.speculative import parse_speculative_config

        if draft_ref is not None:
            raise UsageError("expected either --draft or --speculative-config, found both")
        parsed = parse_speculative_config(spec_config)
        draft_ref, tokens = parsed.bundled_draft()
        from runtime.serve.spec_tree import TreeOptions
        TreeOptions.parse(parsed.extra.get("tree"))  # a serve-time option, but a malformed one is refused here
        num_speculative_tokens = tokens or num_speculative_tokens
        if parsed.method == "eagle3":
            method = "eagle3"
    elif lock_path is not None and draft_ref is None:  # a rebuild from the lock alone speculates as it did
        from bundler.resolve.lockfile import read_lock

        locked = read_lock(lock_path).get("draft")
        method = locked.speculative_method if locked is not None and locked.speculative_method else method
    if not sign_key_paths and not unsigned:
        raise UsageError("expected --sign-key KEY (or an explicit --unsigned), found neither")
    keys = [load_private_key(p, _passphrase_from_env()) for p in sign_key_paths]  # fail before any download
    out = out or Path(f"{name}-{version}")
    model, draft, resolved = resolve_inputs(model_ref, draft_ref, targets=targets, include=include,
                                            exclude=exclude, lock_path=lock_path, max_model_len=max_model_len,
                                            force=force, allow_no_chat_template=allow_no_chat_template,
                                            demo_draft=method == "draft_model", eagle3_head=method == "eagle3",
                                            quantization=quantization)
    layers = None
    if method == "eagle3":
        from bundler.pack.create import eagle3_head_input
        draft, layers = eagle3_head_input(draft, model)
    serve = serve or None
    options = CreateOptions(
        name=name, version=version, model=model, draft=draft, targets=targets, sign_keys=keys, unsigned=unsigned,
        max_part_size=part_size, expires=expires, num_speculative_tokens=num_speculative_tokens, force=force,
        jobs=jobs, progress=not no_progress, serve=serve, checkpoint_weights=with_checkpoint_weights,
        speculative_method=method,
        target_files=target_files_hook(num_speculative_tokens=num_speculative_tokens, serve=serve,
                                       eagle3_layers=layers, quantization=quantization, aot=aot),
        runtime_platforms=platforms, extra_wheels=extra_wheels, wheel_cache=wheel_cache)
    manifest = create_bundle(out, options)
    lock_out = lock_path or write_lock(out.parent / f"{out.name}.lock.json", checked_resolution(resolved, manifest),
                                       speculative_method=method if draft is not None else None,
                                       quantization=quant_record)
    from bundler.pack.keys import public_key_id

    stored = sum(p.size for p in {p.digest: p for f in manifest.files for p in f.parts}.values())
    click.echo(f"bundle:   {out}  ({manifest.name}:{manifest.version})")
    click.echo(f"files:    {len(manifest.files)}, {format_size(manifest.total_size)} "
               f"-> {format_size(stored)} compressed")
    left_out = [o for m in manifest.models for o in m.extra.get("omitted_files", ())]
    if left_out:
        click.echo(f"left out: {len(left_out)} checkpoint files, {format_size(sum(o['size'] for o in left_out))} "
                   f"no target installs (size and sha256 in the manifest; --with-checkpoint-weights carries them)")
    click.echo(f"targets:  {', '.join(t.id for t in manifest.targets)}")
    from bundler.pack.engines import tensorrt_graph_line

    for t in manifest.targets:
        line = tensorrt_graph_line(t)
        if line:
            click.echo(f"tensorrt: {line}")
    for t in manifest.targets:
        rtx = [e for e in t.engines if e.format == "tensorrt-plan" and e.key.get("tensorrt_version", "").startswith("rtx-")]
        if rtx:
            click.echo(f"rtx:      {t.id}: {len(rtx)} TensorRT-RTX {rtx[0].key['tensorrt_version'][4:]} plans for "
                       f"sm_{rtx[0].key['compute_capability'].replace('.', '')} built here ahead of time, signed in")
    for line in quality_lines(manifest):
        click.echo(line)
    for m in manifest.models:
        click.echo(f"model:    {m.role} {m.name} @ {m.source.revision}")
    if manifest.runtime is not None:
        click.echo(f"runtime:  {manifest.runtime.package} {manifest.runtime.version} for "
                   f"{', '.join(manifest.runtime.platforms)} (bootstrap: sh {out}/bootstrap --trust KEY.pub)")
    signers = ", ".join(public_key_id(k) for k in keys) or "UNSIGNED"
    click.echo(f"signed:   {signers}")
    if manifest.expires:
        click.echo(f"expires:  {manifest.expires}")
    click.echo(f"lock:     {lock_out}")
    if manifest.serve:
        from manifests.serve_config import to_args

        click.echo(f"serve:    {' '.join(to_args(manifest.serve)) or manifest.serve}")
