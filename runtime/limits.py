"""Every bound on what one request may ask of `bundle serve`'s engine, in one place.

A request beyond a bound is answered 400 naming the bound and what was found. The grammar bounds keep
one structured-output request from occupying a preprocessing thread for seconds (compile time grows with
the grammar's text) or making every token's mask slow (llguidance's per-step limits).
"""

from __future__ import annotations

#: Prompts in one /v1/completions request.
MAX_PROMPTS = 64
#: Choices in one request, prompts x n: each is one sequence in the engine, a slot or a place in the queue.
MAX_CHOICES = 64
#: Text of one grammar: a JSON schema (as compact JSON), a regex, a Lark/GBNF grammar, a choice list (as JSON).
#: Compiling 64 KiB of JSON schema takes about a quarter of a second on one core.
MAX_GRAMMAR_CHARS = 64 * 1024
#: Entries of one `choice` list. llguidance follows at most 2000 alternatives sharing a prefix (max_items_in_row).
MAX_CHOICE_OPTIONS = 1024
#: llguidance's resource limits for one grammar (llguidance.LLParserLimits), llguidance's defaults except the
#: lexer's initial fuel: at 1_000_000 a regex such as `a{1000}{1000}` takes 1.3-1.9 s to give its first mask.
#: A grammar that hits a limit is refused when it is compiled if its first mask or its forced prefix hits it,
#: else the request ends with an error when generation reaches that point (runtime.serve.grammar).
GRAMMAR_PARSER_LIMITS = {
    "initial_lexer_fuel": 250_000,  # building the lexer's regexes (about 50k per ms)
    "step_lexer_fuel": 200_000,  # one token's mask, lexer side (about 14k per ms)
    "step_max_items": 50_000,  # one token's mask, Earley items (about 20k per ms)
    "max_items_in_row": 2_000,  # alternatives alive at one position
    "max_lexer_states": 250_000,  # about 1-2 kB each
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
}
