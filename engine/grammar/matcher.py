"""A request's grammar constraint inside the engine: an llguidance matcher fed with the request's
output tokens, which gives the next step's allowed-token bitmask.

The constraint may start late: with `after_token` set (thinking mode: `</think>`), the tokens up to
and including that one pass unconstrained and are not shown to the matcher. A rejected token leaves
the state as it was (try_consume, not consume: llguidance's consume puts the matcher into a
permanent error state), so `accept` can be used to probe and `rollback` undoes accepted tokens only.

llguidance is imported lazily: the gateway and the compiler import `tokenizer_id` from here and
must not pay for the library (or torch) to hash a file.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from messages.grammar import tokenizer_id  # noqa: F401 - one rule for the gateway, compiler and engine

_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], object] = {}
_TOKENIZERS_LOCK = threading.Lock()


class GrammarError(ValueError):
    """The grammar does not build a matcher, or tokens already produced do not fit it."""


def build_matcher(tokenizer, grammar: str):
    """A fresh llguidance matcher for `grammar` (GrammarError if it does not build). As slow as the
    compile was for a big grammar; callers that see a grammar often keep one as a template and give
    each request a copy (`GrammarState(..., template=...)`), which takes microseconds."""
    from llguidance import LLMatcher
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"the grammar does not build a matcher: {matcher.get_error()}")
    return matcher


def load_grammar_tokenizer(tokenizer_json_path: str | Path, vocab_size: int, eos_id: int | Sequence[int]):
    """The llguidance.LLTokenizer for a tokenizer.json, with the model's vocabulary size (the logits'
    width, which may exceed the tokenizer's) and EOS: one id, or every id that ends generation (a
    finished grammar then allows, and stops on, any of them). Building one takes about a second, so
    each (path, vocab_size, eos ids) is built once per process."""
    eos_ids = (int(eos_id),) if isinstance(eos_id, int) else tuple(int(i) for i in eos_id)
    if not eos_ids:
        raise ValueError("a grammar tokenizer needs at least one EOS id")
    key = (str(Path(tokenizer_json_path).resolve()), int(vocab_size), eos_ids)
    with _TOKENIZERS_LOCK:
        tokenizer = _TOKENIZERS.get(key)
        if tokenizer is None:
            from llguidance import LLTokenizer
            text = Path(tokenizer_json_path).read_text(encoding="utf-8")
            eos = list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]
            tokenizer = _TOKENIZERS[key] = LLTokenizer(text, n_vocab=key[1], eos_token=eos)
        return tokenizer


class GrammarState:
    """One request's matcher plus the activation bookkeeping; see the module docstring."""

    __slots__ = ("after_token", "_matcher", "_mask_bytes", "_num_accepted", "_activated_at")

    def __init__(self, tokenizer, grammar: str, after_token: int = -1, replay: Sequence[int] = (),
                 template=None):
        """`template`: a pristine matcher of `grammar` (build_matcher) to copy instead of building one."""
        self._matcher = template.deep_copy() if template is not None else build_matcher(tokenizer, grammar)
        self.after_token = int(after_token)
        self._mask_bytes = 4 * ((tokenizer.vocab_size + 31) // 32)
        self._num_accepted = 0
        # num_accepted when the constraint became active (after_token included); None: not active yet.
        self._activated_at: int | None = 0 if self.after_token < 0 else None
        for position, token in enumerate(replay):
            if not self.accept(token):
                raise GrammarError(f"replayed token {token} at output position {position} does not fit the grammar")

    @property
    def active(self) -> bool:
        return self._activated_at is not None

    @property
    def done(self) -> bool:
        """Active and finished: nothing but EOS may follow."""
        return self._activated_at is not None and self._matcher.is_stopped()

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far, before and after activation."""
        return self._num_accepted

    @property
    def mask_words(self) -> int:
        """int32 words in one bitmask row: ceil(vocab_size / 32)."""
        return self._mask_bytes // 4

    def accept(self, token: int) -> bool:
        """Take the next output token. Inactive: watch for `after_token` (always True). Active: feed
        the matcher; False (state unchanged) when the grammar rejects the token."""
        if self._activated_at is None:
            self._num_accepted += 1
            if token == self.after_token:
                self._activated_at = self._num_accepted
            return True
        if self._matcher.try_consume_tokens([int(token)]) != 1:
            return False
        self._num_accepted += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens, back across the activation point if need be."""
        if not 0 <= n <= self._num_accepted:
            raise ValueError(f"cannot roll back {n} of {self._num_accepted} accepted tokens")
        if self._activated_at is not None:
            undo = min(n, self._num_accepted - self._activated_at)
            if undo and not self._matcher.rollback(undo):
                raise GrammarError(f"the matcher failed to roll back {undo} tokens: {self._matcher.get_error()}")
            if n > undo:   # `after_token` itself is undone too
                self._activated_at = None
        self._num_accepted -= n

    def fill(self, target) -> None:
        """Write the next token's bitmask (bit t of word t // 32 set = token t allowed) into `target`:
        a contiguous CPU int32 tensor row of `mask_words` elements, or a raw pointer to that many
        words. Only meaningful while active."""
        if isinstance(target, int):
            self._matcher.unsafe_compute_mask_ptr(target, self._mask_bytes)
            return
        if target.dtype.itemsize != 4 or target.numel() * 4 != self._mask_bytes or not target.is_contiguous() \
                or target.device.type != "cpu":
            raise ValueError(f"a bitmask row is {self.mask_words} contiguous int32 words on the CPU, "
                             f"got {target.dtype}{list(target.shape)} on {target.device}")
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._mask_bytes)

    def matcher_for_batch(self):
        """The llguidance matcher, for a batched fill (mask.fill_bitmasks)."""
        return self._matcher
