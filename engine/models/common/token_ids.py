"""A config's end-of-sequence ids. Hugging Face configs give `eos_token_id` as one id or a list of ids:
generation finishes on any of them; the first is the primary id, for APIs that take one (a grammar's EOS)."""

from __future__ import annotations


def parse_eos_ids(value) -> tuple[int, ...]:
    """`eos_token_id` of a config.json as a tuple of ids, primary first; () for null. Anything that is not
    a non-negative int or a non-empty list of them is refused, naming the field."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"eos_token_id {value!r}: expected a token id or a non-empty list of token ids")
    return tuple(dict.fromkeys(ids))  # duplicates dropped, order kept


def settle_eos_ids(config) -> None:
    """For a frozen config's `__post_init__`: fill `eos_token_ids` from `eos_token_id` when not given, and
    check that the primary id leads the list."""
    primary, ids = config.eos_token_id, tuple(config.eos_token_ids)
    if not ids and primary is not None:
        ids = (primary,)
    if primary is None and ids or primary is not None and ids[0] != primary:
        raise ValueError(f"eos_token_id {primary!r} must be the first of eos_token_ids {ids}")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"eos_token_ids {ids}: expected non-negative token ids")
    object.__setattr__(config, "eos_token_ids", ids)
