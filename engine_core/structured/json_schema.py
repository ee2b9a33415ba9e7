"""JSON schemas into xgrammar grammars, with a work-around for its length-bounded strings.

xgrammar 0.2.9 compiles a string with `minLength`/`maxLength` to a repetition of the bare class
`[^"\\\r\n]`, which admits raw control characters U+0000-U+001F other than CR/LF (mlc-ai/xgrammar#800;
fix PRs #822 and #880 are open): a sampled tab or \x0b inside such a string is invalid JSON that strict
parsers refuse (our random-weight test model hit it in 5 of 100 outputs). Its unbounded strings use
`[^\0-\x1f"\\\r\n]`. So where the grammar has the bare class we swap in the unbounded strings' class and
compile the patched EBNF; that costs the same compile time, where rewriting the schema to an equivalent
`pattern: ^.{0,n}$` took 18x longer (257 ms against 14 ms at n=24). Escapes stay unemittable inside
bounded strings, as in xgrammar itself. Once a fixed xgrammar is the floor the class is gone from its
output and this does nothing.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

BARE_STRING_CLASS = r'[^\"\\\r\n]'  # as xgrammar prints it in EBNF
SAFE_STRING_CLASS = r'[^\0-\x1f\"\\]'  # JSON's unescaped characters; CR and LF are in \0-\x1f


def compile_json_schema(compiler: xgrammar.GrammarCompiler, schema: dict[str, Any] | str,
                        **layout: Any) -> xgrammar.CompiledGrammar:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema), **layout)
    ebnf = str(grammar)
    if BARE_STRING_CLASS in ebnf:
        return compiler.compile_grammar(ebnf.replace(BARE_STRING_CLASS, SAFE_STRING_CLASS))
    return compiler.compile_grammar(grammar)
