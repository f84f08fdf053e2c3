"""The rows of a packed V4.1 batch that run the layers above the last KV source.

A trimmed replay (engine/kv/manager.py; the state's `trim_from`) runs those layers on the prompt's
last window rows only: rows before `trim_from` stop after the last KV source, since nothing cached
or decoded later reads their upper-layer KV. The upper layers then run on a sub-batch: each
sequence keeps a suffix of its chunk (all of it unless trimmed), and a sequence left with no row
drops out. Everything per row (ids, positions, rope angles, Engram rows, image flags) is selected;
per sequence, the span, the state and the selection of compressed entries are cut to the suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.v41.attention import Selection, V41Batch


@dataclass(slots=True)
class SubBatch:
    batch: V41Batch
    rows: torch.Tensor  # [T'] the full batch's rows, in packed order
    members: list[int]  # the full batch's sequences that keep rows, in order


def trimmed_rows(batch: V41Batch) -> list[int] | None:
    """Per sequence, how many leading rows of its chunk are below its state's `trim_from`; None when
    no sequence has any (ordinary prefills, decodes, a replay past its trim point)."""
    skips = [min(max(0, state.trim_from - selection.first), end - start)
             for (start, end), state, selection in zip(batch.spans, batch.states, batch.selections)]
    return skips if any(skips) else None


def select_rows(batch: V41Batch, skips: list[int]) -> SubBatch:
    """The sub-batch without each sequence's first `skips[i]` rows."""
    rows, spans, members, selections, packed = [], [], [], [], 0
    for i, ((start, end), skip) in enumerate(zip(batch.spans, skips)):
        count = end - start - skip
        if count <= 0:
            continue
        rows.append(torch.arange(start + skip, end))
        spans.append((packed, packed + count))
        packed += count
        members.append(i)
        old = batch.selections[i]
        selections.append(Selection(old.first + skip, count, _suffix(old.chosen, skip), _suffix(old.candidates, skip)))
    device = batch.input_ids.device
    index = torch.cat(rows).to(device) if rows else torch.empty(0, dtype=torch.long, device=device)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[index]

    sub = V41Batch(
        input_ids=batch.input_ids[index], positions=batch.positions[index], spans=spans,
        states=[batch.states[i] for i in members], angles={name: a[index] for name, a in batch.angles.items()},
        selections=selections, image_mask=pick(batch.image_mask),
        captures=[batch.captures[i] for i in members] if batch.captures else [],
        engram_rows=pick(batch.engram_rows), engram_dead=pick(batch.engram_dead))
    return SubBatch(sub, index, members)


def _suffix(rows: torch.Tensor | None, skip: int) -> torch.Tensor | None:
    """A selection's rows from `skip` on (its columns, the entries visible by the chunk's end, stay)."""
    return None if rows is None else rows[skip:]
