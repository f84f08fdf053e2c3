"""Structured output in the engine: per-request llguidance matchers (matcher.py) and the batched
token bitmask applied to the logits before sampling (mask.py, which needs torch; this package's
top level does not, so the gateway and the compiler can import `tokenizer_id` alone)."""

from engine.grammar.matcher import GrammarError, GrammarState, build_matcher, load_grammar_tokenizer, tokenizer_id

__all__ = ["GrammarError", "GrammarState", "build_matcher", "load_grammar_tokenizer", "tokenizer_id"]
