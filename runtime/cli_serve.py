"""`bundle serve`: flags, then one call to runtime.server.serve. Flag names follow `vllm serve`."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("serve")
@click.argument("bundle", metavar="NAME|DIR")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Store to serve an installed bundle from (default: $BUNDLE_STORE).")
@click.option("--dir", "as_dir", is_flag=True, help="Take the argument as a bundle directory even without a '/'.")
@click.option("--ignore-expiry", is_flag=True,
              help="Serve a bundle past its expiry (judged by the store's clock, as install does).")
@click.option("--target", default="auto", show_default=True,
              help="Target profile id; 'auto' uses the installed one (or detects it for a bundle directory).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--speculative-config", "speculative_config", default=None, metavar="JSON",
              help='vLLM-style JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_max": 4}\'. Methods: draft_model (the bundle\'s draft), ngram, none. '
                   "Default: the bundle manifest's setting.")
@click.option("--no-speculation", is_flag=True, help="Plain decoding with the target only.")
@click.option("--max-model-len", type=click.IntRange(16, None), default=None,
              help="Context length (prompt + output) in tokens; default: the bundle's setting or the engine's limit.")
@click.option("--max-queued-requests", type=click.IntRange(0, None), default=16, show_default=True,
              help="Requests that may wait while one generates; more get HTTP 429.")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/ routes.")
@click.option("--served-model-name", default=None, help="Model id clients use (default: the bundle name).")
@click.option("--trust", "trust", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Public key (*.pub) to verify a bundle directory with (repeatable), besides the trust dir.")
@click.option("--allow-unsigned", is_flag=True, help="Serve an unsigned bundle directory (digests still checked).")
@click.option("--log-interval", type=click.FloatRange(1, None), default=10.0, show_default=True,
              help="Seconds between log lines with tokens/s and acceptance rate.")
def serve(bundle, store, as_dir, ignore_expiry, target, host, port, speculative_config, no_speculation, max_model_len,
          max_queued_requests, api_key, served_model_name, trust, allow_unsigned, log_interval):
    """Serve an installed bundle (by NAME) or a bundle directory over an OpenAI-compatible API.

    NAME or DIR: the argument is a directory when it contains a '/' (or is '.', or --dir is given),
    otherwise the name of a bundle installed in --store; a folder ./demo in the working directory
    never stands in for `demo`. The first line printed says which was used.

    A bundle directory is verified first (signature and digests, as `bundle install`) and
    unpacked into a private temporary store, removed on exit (Ctrl-C or SIGTERM too). An expired
    bundle is refused (exit 5) unless --ignore-expiry. Nothing is fetched from the network.

    \b
    Endpoints: /v1/models, /v1/chat/completions, /v1/completions, /health, /health/ready, /metrics.

    \b
    Examples:
      bundle serve demo --store /data/store --port 8000
      bundle serve /media/usb/demo-v3 --trust fleet.pub --speculative-config '{"method": "ngram"}'
      bundle serve --dir demo-v3 --trust fleet.pub      # a directory in the working directory
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "demo", "messages": [{"role": "user", "content": "hi"}]}'
    """
    from manifests.errors import UsageError
    from runtime.server import serve as run_server
    from runtime.server.loader import parse_speculative_config
    from runtime.store import bundle_ref

    if no_speculation and speculative_config:
        raise UsageError("--no-speculation and --speculative-config contradict each other; pass one")
    run_server(bundle_ref(bundle, is_dir=as_dir), store=store, ignore_expiry=ignore_expiry, host=host, port=port,
               target=target,
               speculative_config=parse_speculative_config(speculative_config), no_speculation=no_speculation,
               max_model_len=max_model_len, max_queued_requests=max_queued_requests, api_key=api_key,
               trust=tuple(trust), allow_unsigned=allow_unsigned, log_interval_s=log_interval,
               served_model_name=served_model_name, echo=click.echo)
