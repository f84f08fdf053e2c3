"""The GenerateChunks a worker streams to the gateway: one per engine output, and the error chunk."""
from __future__ import annotations

from messages.common import FinishReason, TopLogprob, Usage
from messages.generate import GenerateChunk


def logprob_fields(out) -> tuple[list[float], list[list[TopLogprob]]]:
    """An engine RequestOutput's logprobs and top logprobs in their wire form (empty if not asked)."""
    return list(out.logprobs or []), [[TopLogprob(t, lp) for t, lp in row] for row in (out.top_logprobs or [])]


def chunk_from(out, completion_tokens: int, first_index: int = -1) -> GenerateChunk:
    """`out` is an engine RequestOutput; usage travels on the last chunk only. `first_index`: where
    its tokens start in the output (GenerateChunk.first_index)."""
    finished = out.finish_reason is not None
    logprobs, top_logprobs = logprob_fields(out)
    return GenerateChunk(
        token_ids=list(out.new_token_ids),
        finish_reason=int(out.finish_reason) if finished else int(FinishReason.NONE),
        logprobs=logprobs, top_logprobs=top_logprobs,
        usage=Usage(out.num_prompt_tokens, out.num_cached_tokens, completion_tokens) if finished else None,
        first_index=first_index)


ENGINE_FAILURE = GenerateChunk([], int(FinishReason.ERROR), error="engine failure")


def fail_streams(service, streams) -> None:
    """After a failed engine step: tell each stream's gateway (best effort: one that is gone is gone)."""
    from messages.errors import WireError
    for request_id, stream in streams:
        try:
            service.send(stream.return_address, ENGINE_FAILURE, request_id=request_id, span=stream.span)
        except WireError:
            pass
