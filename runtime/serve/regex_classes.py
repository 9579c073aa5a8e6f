"""ASCII meanings for a request regex's `\\d`, `\\w` and `\\s`, as vLLM's default backend gives them.

llguidance reads a `regex` with Rust's Unicode classes: `\\d` is any of Unicode's 700-odd decimal digits,
each two to four bytes. xgrammar (vLLM's default) reads `\\d` as `[0-9]`, `\\w` as `[a-zA-Z0-9_]` and `\\s`
as `[ \\t\\n\\r\\f\\v]`, and so does a JSON schema's `pattern` (ECMAScript) in both. A client that asks for
`\\d{3}` expects ASCII digits, and a small model let loose among Unicode's digits spends its tokens on
multi-byte ones and runs out before the pattern closes. `ascii_classes` rewrites the six escapes to those
sets and leaves everything else (`\\p{..}`, `.`, literal text) as written.
"""

from __future__ import annotations

_SETS = {"d": "0-9", "w": "a-zA-Z0-9_", "s": r" \t\n\r\f\v"}


def _expand(letter: str, in_class: bool) -> str:
    """One of \\d \\D \\w \\W \\s \\S as a class; inside a class, as its items or a nested class (Rust's
    regex nests classes, `[a[^0-9]]`)."""
    items = _SETS[letter.lower()]
    if letter.isupper():
        return f"[^{items}]"
    return items if in_class else f"[{items}]"


def ascii_classes(regex: str) -> str:
    r"""`regex` with \d \D \w \W \s \S outside and inside character classes given their ASCII sets."""
    out: list[str] = []
    depth = 0  # nesting of character classes
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            nxt = regex[i + 1]
            out.append(_expand(nxt, depth > 0) if nxt.lower() in _SETS else regex[i:i + 2])
            i += 2
            continue
        if c == "[":
            if depth and regex.startswith("[:", i):  # [[:digit:]]: a POSIX class, copied whole
                end = regex.find(":]", i + 2)
                if end != -1:
                    out.append(regex[i:end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            # a ']' first in a class ("[]a]", "[^]a]") is a literal, not the class's end
            if i < n and regex[i] == "^":
                out.append("^")
                i += 1
            if i < n and regex[i] == "]":
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)
