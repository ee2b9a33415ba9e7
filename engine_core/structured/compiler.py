"""Compile constraints into xgrammar grammars: cached by content, and off the step loop.

`submit()` compiles in this compiler's own thread (xgrammar releases the GIL while it compiles, so
the step thread keeps running) and hands back a future; `compile()` waits for the same cache entry,
compiling in the calling thread only when nobody asked before. The async engine submits and awaits
before it adds a request, so by the time the step thread adds it the grammar is a cache hit.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_core.structured.json_schema import compile_json_schema
from engine_core.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# the cache of compiled grammars, the only one (xgrammar's own is off: it has no bound by default)
MAX_CACHED = 1024
MAX_CACHED_BYTES = 256 * 2**20
# JSON layout: whitespace is allowed (so both `{"a":1}` and `{"a": 1}` are fine and the model keeps its own
# habit) but capped, so a small model at high temperature cannot wander into a run of spaces or newlines
# that eats max_tokens. xgrammar's any_whitespace=False would force `", "`/`": "` unless separators are set;
# forced-compact and this gave the same validity on SmolLM2 at temperature 1 (148 and 149 of 150).
MAX_JSON_WHITESPACE = 1

_NOISE = re.compile(r"^\[[\d:]+\] \S+\.cc:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """The constraint cannot be compiled (an invalid schema, a regex or grammar the library refuses)."""


@dataclass(slots=True)
class CompileStats:
    hits: int = 0  # constraints found in the cache (compiled, or being compiled)
    misses: int = 0  # constraints compiled
    inline: int = 0  # of those, compiled in the thread that adds requests rather than the compile thread
    errors: int = 0


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width, which may exceed the tokenizer's vocab
        self._stop_token_ids = list(stop_token_ids)
        self._xgr: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.cached_bytes = 0
        # one thread: a compile needs one core; more would only compete with the step loop for the rest
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.stats = CompileStats()

    def submit(self, params: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar, now or later; a failure is a GrammarError in the future."""
        future, new = self._entry(params)
        if new:
            self._pool.submit(self._fill, future, params)
        return future

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        future, new = self._entry(params)
        if new:
            self.stats.inline += 1
            self._fill(future, params)
        return future.result()

    def _entry(self, params: StructuredOutputsParams) -> tuple[Future[xgrammar.CompiledGrammar], bool]:
        key = _key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return future, False
            future = Future()
            self._cache[key] = future
            self.stats.misses += 1
            self._evict()
            return future, True

    def _evict(self) -> None:
        """Oldest first, under the lock. A grammar evicted while compiling still reaches who asked for it."""
        while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED or self.cached_bytes > MAX_CACHED_BYTES):
            key, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(key, 0)

    def _fill(self, future: Future[xgrammar.CompiledGrammar], params: StructuredOutputsParams) -> None:
        try:
            compiled = self._compile(params)
        except Exception as exc:  # the library raises RuntimeError with its C++ location; keep the message
            self.stats.errors += 1
            future.set_exception(GrammarError(f"invalid {_describe(params)}: {_clean(exc)}"))
            return
        future.set_result(compiled)
        key = _key(params)
        with self._lock:
            if self._cache.get(key) is future:
                self._sizes[key] = compiled.memory_size_bytes
                self.cached_bytes += compiled.memory_size_bytes
                self._evict()

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        comp = self._compiler()
        kind = params.kind
        if kind == "json":
            return compile_json_schema(comp, params.json or {}, any_whitespace=True,
                                       max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "json_object":
            return compile_json_schema(comp, {"type": "object"}, any_whitespace=True,
                                       max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return comp.compile_regex(str(params.regex))
        if kind == "choice":
            return comp.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice or ()))
        if kind == "grammar":
            return comp.compile_grammar(str(params.grammar))
        raise GrammarError(f"unknown structured output kind {kind!r}")

    def _compiler(self) -> xgrammar.GrammarCompiler:
        # built on first use: importing xgrammar and reading the vocabulary take ~0.5-1 s
        with self._init_lock:
            if self._xgr is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._xgr = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr


def _key(params: StructuredOutputsParams) -> tuple[str, str]:
    try:
        return params.cache_key()
    except (TypeError, ValueError) as exc:  # a schema dict json.dumps cannot write
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def _describe(params: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice list", "grammar": "EBNF grammar"}.get(params.kind, "constraint")


def _clean(exc: Exception) -> str:
    return _NOISE.sub("", str(exc).strip()).strip()


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'
