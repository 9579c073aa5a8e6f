"""`bundle serve`: flags, then one call to runtime.server.serve. Flag names follow `vllm serve`.

Every `vllm serve` flag in manifests.serve_config.FLAGS becomes an option here (unless this module
declares it itself), so a pasted vLLM command line never meets "No such option": each flag is applied,
noted at startup as having no effect (with why), or refused with what to do. Values given on the command
line lie over the bundle's own serve defaults (its manifest's `serve` section).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from manifests import serve_config
from manifests.limits import LIMITS


def _help(flag: serve_config.Flag) -> str:
    text = flag.help
    if flag.refuse:
        return f"{text} Refused here: {flag.refuse}."
    if isinstance(flag.effect, str):
        return f"{text} Accepted, no effect here: {flag.effect}."
    if flag.effect is not None:
        return f"{text} (vLLM flag; the startup note says what it does here.)"
    return text


def vllm_flags(command: click.Command) -> click.Command:
    """Add an option for every vLLM flag the command does not declare itself."""
    declared = {o for p in command.params for o in getattr(p, "opts", ())}
    for flag in serve_config.FLAGS:
        if flag.name in declared:
            continue
        if flag.kind == "bool":
            opt = click.Option([flag.name, flag.dest], is_flag=True, default=None, help=_help(flag))
        elif flag.kind == "pair":
            opt = click.Option([f"{flag.name}/--no-{flag.name[2:]}", flag.dest], default=None, help=_help(flag))
        else:
            metavar = {"int": "N", "float": "X", "json": "JSON"}.get(flag.kind, "TEXT")
            if flag.choices:
                metavar = "[" + "|".join(flag.choices) + "]"
            opt = click.Option([flag.name, flag.dest], default=None, multiple=flag.multiple, metavar=metavar,
                               help=_help(flag))
        command.params.append(opt)
    return command


def given_serve_args(ctx: click.Context, values: dict) -> dict:
    """The vLLM flags typed on the command line (not defaults), converted to their types."""
    out = {}
    for flag in serve_config.FLAGS:
        if flag.dest not in values:
            continue
        source = ctx.get_parameter_source(flag.dest)
        if source not in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT):
            continue
        value = values[flag.dest]
        if flag.multiple and not value:
            continue
        out[flag.dest] = serve_config.convert(flag, list(value) if flag.multiple else value)
    return out


class VllmServeCommand(click.Command):
    """Takes vLLM's multi-value form `--served-model-name a b` as well."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, serve_config.expand_multiple(list(args)))


@vllm_flags
@click.command("serve", cls=VllmServeCommand, context_settings={"max_content_width": 110})
@click.argument("bundle", metavar="NAME|DIR")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Store to serve an installed bundle from (default: $BUNDLE_STORE).")
@click.option("--dir", "as_dir", is_flag=True, help="Take the argument as a bundle directory even without a '/'.")
@click.option("--ignore-expiry", is_flag=True,
              help="Serve a bundle past its expiry (judged by the store's clock, as install does).")
@click.option("--target", default="auto", show_default=True,
              help="Target profile id; 'auto' uses the installed one (or detects it for a bundle directory).")
@click.option("--no-speculation", is_flag=True, help="Plain decoding with the target only.")
@click.option("--max-queued-requests", type=click.IntRange(0, None), default=16, show_default=True,
              help="Sequences (each choice of a request: prompts x n) that may wait for a slot; more get HTTP 429.")
@click.option("--trust", "trust", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Public key (*.pub) to verify a bundle directory with (repeatable), besides the trust dir.")
@click.option("--allow-unsigned", is_flag=True, help="Serve an unsigned bundle directory (digests still checked).")
@click.option("--log-interval", type=click.FloatRange(1, None), default=10.0, show_default=True,
              help="Seconds between log lines with tokens/s and acceptance rate.")
@click.option("--header-timeout", type=click.FloatRange(0.1, 3600), default=LIMITS.header_timeout_s,
              show_default=True, help="Seconds a connection has to send a request's line and headers (from "
              "connecting, or from the previous response); then it is closed.")
@click.option("--body-timeout", type=click.FloatRange(0.1, 3600), default=LIMITS.body_timeout_s,
              show_default=True, help="Seconds a request has to send its body once its headers are in; then "
              "the connection is closed.")
@click.option("--max-connections-per-client", type=click.IntRange(1, None),
              default=LIMITS.max_connections_per_client, show_default=True,
              help="Connections one client address may hold open; more are closed at once.")
@click.pass_context
def serve(ctx, bundle, store, as_dir, ignore_expiry, target, no_speculation, max_queued_requests, trust,
          allow_unsigned, log_interval, header_timeout, body_timeout, max_connections_per_client, **vllm):
    """Serve an installed bundle (by NAME) or a bundle directory over an OpenAI-compatible API.

    NAME or DIR: the argument is a directory when it contains a '/' (or is '.', or --dir is given),
    otherwise the name of a bundle installed in --store; a folder ./demo in the working directory
    never stands in for `demo`. The first line printed says which was used.

    A bundle directory is verified first (signature and digests, as `bundle install`) and
    unpacked into a private temporary store, removed on exit (Ctrl-C or SIGTERM too). An expired
    bundle is refused (exit 5) unless --ignore-expiry. Nothing is fetched from the network.
    `vllm serve` flags are accepted as vLLM spells them; the bundle's own serve defaults
    (`bundle create --serve-arg`) apply where the command line gives none.

    \b
    Endpoints: /v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /tokenize,
    /detokenize, /version, /health, /health/ready, /metrics. With --api-key, every one but
    /health and /health/ready needs the key.

    \b
    Examples:
      bundle serve demo --store /data/store --port 8000
      bundle serve /media/usb/demo-v3 --trust fleet.pub --speculative-config '{"method": "ngram"}'
      bundle serve demo --served-model-name qwen38 --enable-auto-tool-choice --tool-call-parser hermes \\
        --reasoning-parser qwen3 --max-model-len 4k --trust-remote-code
      bundle serve --dir demo-v3 --trust fleet.pub      # a directory in the working directory
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "demo", "messages": [{"role": "user", "content": "hi"}]}'
    """
    from manifests.errors import UsageError
    from runtime.server import serve as run_server
    from runtime.server.options import ServeConfig
    from runtime.store.store import bundle_ref

    args = given_serve_args(ctx, vllm)
    if no_speculation and "speculative_config" in args:
        raise UsageError("--no-speculation and --speculative-config contradict each other; pass one")
    serve_config.check(args, complete=False)  # refusals before anything is opened
    config = ServeConfig(args=args, store=store, target=target, trust=tuple(trust), allow_unsigned=allow_unsigned,
                         ignore_expiry=ignore_expiry, no_speculation=no_speculation,
                         max_queued_requests=max_queued_requests, log_interval_s=log_interval,
                         http=replace(LIMITS, header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                                      max_connections_per_client=max_connections_per_client))
    run_server(bundle_ref(bundle, is_dir=as_dir), config, echo=click.echo)
