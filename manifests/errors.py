"""One exception hierarchy for the whole tool, each class bound to a documented exit code.

The user's next step differs by class, so the classes split along it:
a bad bundle (get a good copy), a refusal by policy (pass a flag or get a newer bundle),
a bad environment (fix the machine), bad input on the command line (fix the command),
a failed model resolution (fix the model reference or the network).
The CLI maps these to exit codes in one place (`runtime.cli.main.main`); messages are one line
that names what was expected and what was found.
"""

from __future__ import annotations

import unicodedata


class BundleError(Exception):
    """Base of every error the tool reports without a traceback."""

    exit_code = 1
    kind = "error"


class UsageError(BundleError):
    """The command line or a file it names is wrong (bad size string, missing key file...)."""

    exit_code = 2
    kind = "usage error"


class BadBundleError(BundleError):
    """The bundle itself is bad: corrupt, truncated, missing parts, malformed manifest.

    Next step: copy the bundle again from a good source.
    """

    exit_code = 3
    kind = "bad bundle"


class TrustError(BadBundleError):
    """Signature missing, invalid, or made by a key the device does not trust."""

    exit_code = 4
    kind = "untrusted bundle"


class PolicyError(BundleError):
    """The bundle is intact and trusted but refused by policy: expired, downgrade, wrong format version.

    Next step: get a newer bundle, or override with the flag the message names.
    """

    exit_code = 5
    kind = "refused"


class EnvironmentProblem(BundleError):
    """The machine is the problem: no space, permissions, wrong device, missing optional dependency.

    Next step: fix the machine; the bundle is fine.
    """

    exit_code = 6
    kind = "environment"


class ResolveError(BundleError):
    """A model reference could not be resolved to exact bytes (not found, gated, offline, digest drift)."""

    exit_code = 7
    kind = "resolve error"


class ModelError(BundleError):
    """A model cannot be bundled or served: unsupported architecture, too big, tokenizer mismatch."""

    exit_code = 8
    kind = "model error"


class ServeError(BundleError):
    """The server cannot start (port in use, engine failed to load)."""

    exit_code = 9
    kind = "serve error"


class RegistryError(BundleError):
    """An OCI registry could not be used: unreachable, stopped answering, or it has no such repository or tag."""

    exit_code = 10
    kind = "registry error"


class RegistryAuthError(RegistryError):
    """The registry refused the credentials (or none were found for it), or names a token realm on another
    host, which would get them."""

    exit_code = 11
    kind = "registry credentials"


class RegistryTLSError(RegistryError):
    """The registry's TLS certificate is not signed by a trusted CA."""

    exit_code = 12
    kind = "registry certificate"


EXIT_CODES = {
    0: "success",
    1: "unexpected internal error (run with --debug for the traceback)",
    UsageError.exit_code: "bad command line or input file",
    BadBundleError.exit_code: "bad bundle: corrupt, truncated, missing parts or malformed manifest",
    TrustError.exit_code: "untrusted bundle: unsigned, bad signature, or signer not trusted",
    PolicyError.exit_code: "refused by policy: expired, downgrade, unsupported format version",
    EnvironmentProblem.exit_code: "bad environment: no space, permissions, wrong device, missing dependency",
    ResolveError.exit_code: "model reference could not be resolved to exact bytes",
    ModelError.exit_code: "model cannot be bundled or served on this target",
    ServeError.exit_code: "server could not start",
    RegistryError.exit_code: "registry unreachable or stopped answering, or it has no such repository or tag",
    RegistryAuthError.exit_code: "registry refused the credentials (or none found for it, or its token realm is "
                                 "on another host)",
    RegistryTLSError.exit_code: "registry's TLS certificate is not trusted (pass --ca-file)",
}


#: Unicode's bidirectional overrides and isolates: they reorder what a terminal shows (category Cf).
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` safe for a terminal: control characters (an ESC that would set the window title or move the
    cursor, a CR that would overwrite the line, C1 codes, bidi overrides) shown as \\x1b-style escapes.

    Messages carry text from outside (a registry's error, a file name, a realm URL); printed raw, it could
    rewrite what the user sees. `keep_newlines` keeps line breaks (and tabs) of the tool's own messages.
    """
    out = []
    for ch in text:
        if (keep_newlines and ch in "\n\t") or not (unicodedata.category(ch) == "Cc" or ch in _BIDI):
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)
