"""Every bound the house puts on what it reads, is asked for or holds, in one place.

One frozen `Limits`, read through its one default instance: `from manifests.limits import LIMITS`, then
`LIMITS.manifest_bytes`. A value beyond a bound is refused with a one-line error naming the bound and what
was found. Each field says why its value is what it is. `bundle serve` lays its connection flags
(--header-timeout, --body-timeout, --max-connections-per-client, --h11-max-incomplete-event-size,
--h11-max-header-count) over LIMITS with `dataclasses.replace`; nothing else changes at run time.
Standard library only: the device's `floor/` distribution carries this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KiB, MiB = 1024, 1024 * 1024


def _grammar_parser_limits() -> dict:
    return {
        "initial_lexer_fuel": 250_000,  # building the lexer's regexes (about 50k per ms)
        "step_lexer_fuel": 200_000,  # one token's mask, lexer side (about 14k per ms)
        "step_max_items": 50_000,  # one token's mask, Earley items (about 20k per ms)
        "max_items_in_row": 2_000,  # alternatives alive at one position
        "max_lexer_states": 250_000,  # about 1-2 kB each
        "max_grammar_size": 500_000,  # symbols in the grammar's productions
    }


@dataclass(frozen=True)
class Limits:
    # --- a bundle's files (untrusted until verified; bounded before they are parsed) ---
    manifest_bytes: int = 8 * MiB
    """bundle.json: a manifest for a 100 GB model cut in 4 GB parts is a few hundred KB."""
    oci_layout_bytes: int = 4 * KiB
    """oci-layout: one line of JSON."""
    oci_index_bytes: int = 1 * MiB
    """A bundle's index.json: one entry per manifest, a few hundred bytes each."""
    oci_manifest_bytes: int = 16 * MiB
    """An OCI image manifest: one descriptor per layer; the manifest it carries is bounded by manifest_bytes."""
    envelope_bytes: int = 16 * MiB + 64 * KiB
    """A DSSE signature envelope: the base64 of a manifest (at most 16 MiB of OCI manifest) plus signatures."""
    path_bytes: int = 1024
    """One path in a manifest: paths land under STORE/bundles/NAME/VERSION/ on ext4 (4096-byte paths) and on
    FAT sticks during copy; a longer manifest path could not be installed, so it is not valid."""
    name_bytes: int = 255
    """One component of such a path: ext4's and FAT's longest file name."""
    zstd_window_bytes: int = 1 << 27
    """zstd's own default decoder limit (ZSTD_WINDOWLOG_LIMIT_DEFAULT = 27): whatever `zstd -d` reads without
    --long is read; a frame asking for more memory is refused instead of allocated."""
    profile_bytes: int = 64 * KiB
    """A target profile file is a few hundred bytes; anything absurd is refused before parsing."""
    serve_arg_chars: int = 64 * KiB
    """One value in a serve config (a vLLM flag): a JSON speculative config or a chat template path."""
    speculative_config_chars: int = 16 * KiB
    """A speculative config as JSON text: a dozen keys."""
    speculative_tokens: int = 16
    """num_speculative_tokens: past a handful of drafted tokens, acceptance falls and each step costs more."""

    # --- the device store ---
    state_bytes: int = 1 * MiB
    """The store's state file: about 10 000 bundle names."""
    info_bytes: int = 64 * KiB
    """A file the store keeps beside an installed version (its origin, its install record)."""
    key_file_bytes: int = 64 * KiB
    """A PEM key file (a public key trusted on the device, a signing key on the build host): a few hundred bytes."""
    signatures: int = 64
    """Signatures in one envelope: one per signing key, and no one signs with 64 keys."""
    referrers: int = 64
    """Referrers (signatures) a registry lists for one bundle, read at most."""
    referrer_manifest_bytes: int = 64 * KiB
    """One referrer's manifest: one layer descriptor and a few annotations."""
    remote_config_bytes: int = 4 * MiB
    """A registry's config blob: containers/image reads at most this much into memory (iolimits.MaxConfigBodySize)."""
    device_model_bytes: int = 4 * KiB
    """/proc/device-tree/model: one line naming the board."""

    # --- a model's files, where the runtime reads them ---
    tokenizer_bytes: int = 256 * MiB
    """tokenizer.json: a 250k vocabulary takes about 30 MB; the same bound on the build host and the device."""
    tokenizer_config_bytes: int = 16 * MiB
    """tokenizer_config.json, generation_config.json, chat_template.json: a few KB, but tokenizer_config.json
    may list every added token (hundreds of thousands in some vocabularies) and a chat template."""
    template_bytes: int = 1 * MiB
    """A --chat-template file or a --generation-config folder's generation_config.json: templates are a few KB."""
    shared_weights_index_bytes: int = 16 * MiB
    """shared_weights.json beside a decode graph: one entry per external tensor (thousands in a large model)."""
    engine_cache_key_bytes: int = 64 * KiB
    """An engine cache entry's key.json: a dozen strings naming what the engine was built from."""

    # --- the build host ---
    model_config_bytes: int = 4 * MiB
    """A checkpoint's config.json: a few KB; smaller than tokenizer_config_bytes since it never lists tokens."""
    safetensors_header_bytes: int = 100 * MiB
    """The safetensors format itself caps its JSON header at 100 MB."""
    lock_bytes: int = 4 * MiB
    """A bundle.lock: one line per resolved file."""
    local_files: int = 10_000
    """A checkpoint folder with more files than this is not a checkpoint (a home directory passed by mistake?)."""
    file_patterns: int = 64
    """--include/--exclude patterns together; more is surely a mistake."""
    calibration_text_bytes: int = 4 * MiB
    """A --calibration-text file is read up to this much (the quality measurement uses far fewer tokens)."""
    corpus_file_bytes: int = 1_000_000
    """The demo corpus skips source files larger than this (generated code, vendored data)."""

    # --- one request to `bundle serve` ---
    body_bytes: int = 8 * MiB
    """A request body above this is refused (413)."""
    bytes_per_token: int = 32
    """Most UTF-8 bytes one token stands for, generously: English averages about 4, CJK about 3 to 6, code 3;
    only a prompt of nothing but long runs of one character averages more. A prompt of more than
    max_model_len x this many bytes cannot fit the context, and is refused without tokenizing it."""
    detokenize_ids: int = 1 << 20
    """Token ids one /detokenize request may send."""
    prompts: int = 64
    """Prompts in one /v1/completions request."""
    choices: int = 64
    """Choices in one request, prompts x n: each is one sequence in the engine, a slot or a place in the queue."""
    stop_strings: int = 16
    """Stop strings in one request: each is matched against every new piece of text."""
    stop_length: int = 256
    """Characters of one stop string."""
    tool_calls: int = 64
    """Tool calls parsed out of one completion."""
    grammar_chars: int = 64 * KiB
    """One grammar's text: a JSON schema (as compact JSON), a regex, a Lark/GBNF grammar, a choice list (as
    JSON). Compiling 64 KiB of JSON schema takes about a quarter of a second on one core, so one
    structured-output request never holds a preprocessing thread for seconds."""
    choice_options: int = 1024
    """Entries of one `choice` list. llguidance follows at most 2000 alternatives sharing a prefix."""
    grammar_parser_limits: dict = field(default_factory=_grammar_parser_limits)
    """llguidance's resource limits for one grammar (llguidance.LLParserLimits): llguidance's defaults except
    the lexer's initial fuel, since at 1_000_000 a regex such as `a{1000}{1000}` takes 1.3-1.9 s to give its
    first mask. A grammar that hits a limit is refused when it is compiled if its first mask or its forced
    prefix hits it, else the request ends with an error when generation reaches that point."""

    # --- the server's threads and connections ---
    preprocess_threads: int = 2
    """Threads that decode, render and tokenize small request bodies."""
    large_body_bytes: int = 64 * KiB
    """Bodies above this are decoded, rendered and tokenized in their own thread (large_body_threads), so a
    few huge requests never hold up the preprocess_threads that small requests use."""
    large_body_threads: int = 1
    """Threads for those large bodies."""
    large_bodies: int = 4
    """Large bodies waiting for or in that thread at once; one more is answered 429."""
    fd_reserve: int = 64
    """File descriptors kept for the server itself (engine files, pipes, logs: about a dozen)."""
    listen_backlog: int = 64
    """The listen queue, and how many connections the event loop accepts at one go."""
    accept_batches: int = 4
    """The loop accepts a few such batches before it has closed the connections it refuses, so
    accept_batches x listen_backlog files stay free too."""
    connection_ceiling: int = 4096
    """Connections at most, whatever the open-file limit (each holds buffers of up to max_header_bytes)."""
    max_connections: int | None = None
    """Connections at once; None: what the open-file limit leaves room for (704 of systemd's 1024), at most
    connection_ceiling. When full, a new connection closes the oldest one still sending its request."""
    header_timeout_s: float = 10.0
    """--header-timeout: a request's line and headers arrive within this of connecting (or of the last response)."""
    body_timeout_s: float = 60.0
    """--body-timeout: a request's body arrives within this of its headers."""
    max_connections_per_client: int = 64
    """--max-connections-per-client: connections one client address holds at once."""
    max_header_bytes: int = 16 * KiB
    """--h11-max-incomplete-event-size: a request's line and headers, h11's default."""
    max_header_count: int = 256
    """--h11-max-header-count: headers in one request, vLLM's default."""
    keep_alive_s: int = 5
    """An idle connection is closed this long after its last response (uvicorn's default)."""


LIMITS = Limits()


def prompt_byte_limit(max_model_len: int, limits: Limits = LIMITS) -> int:
    """Most UTF-8 bytes a prompt may have and still fit a context of `max_model_len` tokens."""
    return max_model_len * limits.bytes_per_token
