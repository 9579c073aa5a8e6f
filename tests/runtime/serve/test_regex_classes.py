"""runtime.serve.regex_classes: a request regex's \\d \\w \\s read as ASCII, as vLLM's default backend does."""

import pytest

from runtime.serve.regex_classes import ascii_classes


@pytest.mark.parametrize("given, expected", [
    (r"\d{3}", r"[0-9]{3}"),
    (r"\D\W\S", r"[^0-9][^a-zA-Z0-9_][^ \t\n\r\f\v]"),
    (r"[\d.]+", r"[0-9.]+"),
    (r"[^\d\s]", r"[^0-9 \t\n\r\f\v]"),
    (r"[a\D]", r"[a[^0-9]]"),              # a negated set inside a class nests (Rust's regex syntax)
    (r"[]\d]", r"[]0-9]"),                 # a ']' first in a class is literal: the class goes on
    (r"[^]\w]", r"[^]a-zA-Z0-9_]"),
    (r"[[:alpha:]\d]", r"[[:alpha:]0-9]"),  # a POSIX class inside a class is copied whole
    (r"\\d\.\p{N}", r"\\d\.\p{N}"),       # an escaped backslash, an escaped dot, a Unicode class: as written
    (r"a\d[b]\w", r"a[0-9][b][a-zA-Z0-9_]"),
    ("trailing\\", "trailing\\"),
])
def test_perl_classes_become_ascii_sets(given, expected):
    assert ascii_classes(given) == expected

