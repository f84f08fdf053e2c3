"""The forward's `captures` argument, checked: per chunk, the block boundaries its state saves at."""

from __future__ import annotations


def checked_captures(captures, chunks, states) -> list[tuple[int, ...]]:
    """captures[i] as a tuple, after checking it ascends within (num_tokens, num_tokens + len(chunk)]."""
    if len(captures) != len(chunks):
        raise ValueError("need one capture list per chunk")
    checked = []
    for positions, chunk, state in zip(captures, chunks, states):
        positions = tuple(int(p) for p in positions)
        first, end = state.num_tokens, state.num_tokens + chunk.numel()
        if list(positions) != sorted(set(positions)) or any(not first < p <= end for p in positions):
            raise ValueError(f"capture positions {positions} must ascend within ({first}, {end}]")
        checked.append(positions)
    return checked
