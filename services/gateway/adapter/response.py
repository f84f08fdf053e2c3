"""Protocol out: worker token ids -> SSE event bytes (ResponseStream) or one JSON body
(ResponseAccumulator).

Per token: EOS / stop ids end the output and are never forwarded; the incremental detokenizer
turns ids into text (UTF-8 split across tokens held back); the OutputScanner makes that text safe
for deepseek-recipe's StreamProcessor, which emits the protocol events. Usage-bearing events get
the adapter's counts; sentinel characters are turned back into marker spellings.

Both classes share `push(token_ids, finish, usage, logprobs=None)` and `fail(error)` (the request
failed outside the worker's output: it died, went silent). After the response is complete (finish
reason, EOS, a stop sequence, an error) `finished` is True and further pushes return nothing:
when that happens before the worker's own finish, abort the worker.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from deepseek_recipe import (
    ChatCompletionRequest, ChatCompletionResponse, InferenceChunk, InferenceFinishReason,
    MessagesRequest, MessagesResponse, PromptUsage, ResponsesRequest, ResponsesResponse,
    StreamProcessor, Tokenizer,
)

from messages.common import FinishReason, Usage
from services.gateway.adapter.detokenizer import IncrementalDetokenizer, TokenTable
from services.gateway.adapter.errors import GatewayError, Protocol, internal, overloaded
from services.gateway.adapter.output_scanner import Stage
from services.gateway.adapter.parsing import OutputParsing
from services.gateway.adapter.usage import TokenCounts, patch_usage

Logprobs = Sequence[tuple[float, Sequence[tuple[int, float]]]]

_REQUEST_CLASS = {Protocol.CHAT: ChatCompletionRequest, Protocol.RESPONSES: ResponsesRequest,
                  Protocol.MESSAGES: MessagesRequest}
_RESPONSE_CLASS = {Protocol.CHAT: ChatCompletionResponse, Protocol.RESPONSES: ResponsesResponse,
                   Protocol.MESSAGES: MessagesResponse}
_ID_PREFIX = {Protocol.CHAT: "chatcmpl-", Protocol.RESPONSES: "resp_", Protocol.MESSAGES: "msg_"}
_LIBRARY_FINISH = {FinishReason.STOP: InferenceFinishReason.Stop,
                   FinishReason.LENGTH: InferenceFinishReason.Length}


@dataclass(frozen=True, slots=True)
class ResponseSpec:
    """Everything needed to build one response; made by `prepare`, shared by its streams."""
    protocol: Protocol
    model: str
    request: Any                      # deepseek_recipe.ConversationRequest
    parsing: OutputParsing
    tokenizer: Tokenizer
    table: TokenTable
    prompt_tokens: int
    stop_token_ids: frozenset[int]
    echo: Any = None                  # ResponsesEcho (Responses only)
    namespace_tools: dict = field(default_factory=dict)

    def new_id(self) -> str:
        return _ID_PREFIX[self.protocol] + uuid.uuid4().hex

    def new_generator(self, response_id: str):
        generator = _REQUEST_CLASS[self.protocol].chunk_generator(self.request, response_id, self.model)
        if self.protocol is Protocol.RESPONSES:
            if self.echo is not None:
                generator = generator.with_echo(self.echo)
            if self.namespace_tools:
                generator = generator.with_namespace_tool_map(self.namespace_tools)
        return generator


class _Pipeline:
    """Shared by stream and accumulator: ids in, library events out (in order)."""

    def __init__(self, spec: ResponseSpec, response_id: str) -> None:
        self.spec = spec
        self.response_id = response_id
        self.counts = TokenCounts(prompt=spec.prompt_tokens)
        self.finished = False
        self.error: GatewayError | None = None
        self._processor = StreamProcessor(spec.new_generator(response_id),
                                          spec.parsing.library_options(), spec.tokenizer)
        self._scanner = spec.parsing.new_scanner()
        self._detok = IncrementalDetokenizer(spec.table)
        self._started = False
        self._worker_completion = 0

    @property
    def rejected_tool_calls(self):
        return self._scanner.rejected

    def push(self, token_ids: Sequence[int], finish: int | None, usage: Usage | None,
             logprobs: Logprobs | None) -> list[tuple[Any, TokenCounts | None]]:
        """Returns the library events, each with the usage to patch into it (None: leave it)."""
        if self.finished:
            return []
        self._take_usage(usage)
        start: list = []
        events: list = []
        at_start = replace(self.counts)
        try:
            finish = _finish_reason(finish)
            if logprobs is not None and len(logprobs) != len(token_ids):
                raise internal(f"the worker sent {len(logprobs)} logprobs for "
                               f"{len(token_ids)} tokens")
            if not self._started:
                self._started = True
                start = self._processor.push(InferenceChunk.ready(prompt_usage=PromptUsage(
                    prompt_tokens=self.counts.prompt, prompt_cache_hit_tokens=self.counts.cached)))
            ids = list(token_ids)
            for i, token_id in enumerate(ids):
                if token_id in self.spec.stop_token_ids:      # EOS: stop here, never forwarded
                    ids, finish = ids[:i], FinishReason.STOP
                    self.counts.completion += 1
                    if logprobs is not None:
                        logprobs = logprobs[:i]
                    break
            self.counts.completion += len(ids)
            events += self._feed(ids, logprobs)
            if not self._processor.finished and finish is not FinishReason.NONE:
                events += self._finish(finish)
        except GatewayError as exc:
            self._fail(exc)
        except RuntimeError as exc:                           # a stream error closes the processor
            self._fail(internal(f"response stream failed: {exc}"))
        if self._processor.finished:
            self.finished = True
        if self._worker_completion:
            self.counts.completion = self._worker_completion
        final = self.counts if self.finished else None
        return [(e, at_start) for e in start] + [(e, final) for e in events]

    def _take_usage(self, usage: Usage | None) -> None:
        if usage is None:
            return
        if usage.prompt_tokens:
            self.counts.prompt = usage.prompt_tokens
        self.counts.cached = min(usage.cached_tokens, self.counts.prompt)
        self._worker_completion = usage.completion_tokens

    def _feed(self, ids: list[int], logprobs: Logprobs | None) -> list:
        """Detokenize and scan token by token; batch runs into text (or tokens) chunks."""
        chunks: list[InferenceChunk] = []
        text: list[str] = []
        run_ids: list[int] = []
        run_lp: list = []
        for i, token_id in enumerate(ids):
            clean_before = not self._detok.pending and not self._scanner.has_held_text
            piece = self._detok.feed(token_id)
            out = self._scanner.feed(piece)
            if self._scanner.stage is Stage.REASONING:
                self.counts.reasoning += 1
            if logprobs is not None and clean_before and piece and out == piece \
                    and not self._detok.pending and not self._scanner.has_held_text:
                if text:
                    chunks.append(InferenceChunk.text("".join(text)))
                    text = []
                run_ids.append(token_id)
                run_lp.append(logprobs[i])
                continue
            if run_ids:
                chunks.append(InferenceChunk.tokens(run_ids, run_lp))
                run_ids, run_lp = [], []
            if out:
                text.append(out)
        if run_ids:
            chunks.append(InferenceChunk.tokens(run_ids, run_lp))
        if text:
            chunks.append(InferenceChunk.text("".join(text)))
        events: list = []
        for chunk in chunks:
            events += self._processor.push(chunk)
            if self._processor.finished:                      # a stop sequence matched
                break
        return events

    def _finish(self, finish: FinishReason) -> list:
        if finish is FinishReason.ABORT:
            raise overloaded("generation was aborted before the response was complete")
        if finish is FinishReason.ERROR:
            raise internal("generation failed in the worker")
        tail = self._scanner.feed(self._detok.flush()) + self._scanner.finish()
        events = self._processor.push(InferenceChunk.text(tail)) if tail else []
        if not self._processor.finished:
            events += self._processor.push(InferenceChunk.finish(_LIBRARY_FINISH[finish]))
        return events

    def fail(self, error: GatewayError) -> bool:
        """End the response with `error`; False when it had already ended."""
        if self.finished:
            return False
        self._fail(error)
        return True

    def _fail(self, error: GatewayError) -> None:
        self.error = error
        self.finished = True
        try:
            self._processor.close()
        except RuntimeError:
            pass

    def render(self, event) -> str:
        return self._scanner.restore(event.to_json())

    def restore(self, text: str) -> str:
        return self._scanner.restore(text)


def _finish_reason(value: int | None) -> FinishReason:
    try:
        return FinishReason(value or FinishReason.NONE)
    except ValueError:
        raise internal(f"the worker sent an unknown finish reason {value!r}") from None


class ResponseStream:
    """Streaming response: push() returns SSE event bytes in the protocol's streaming format."""

    def __init__(self, spec: ResponseSpec, response_id: str | None = None) -> None:
        self._pipe = _Pipeline(spec, response_id or spec.new_id())
        self._protocol = spec.protocol
        self._response_class = _RESPONSE_CLASS[spec.protocol]
        self._events_sent = 0

    @property
    def response_id(self) -> str:
        return self._pipe.response_id

    @property
    def finished(self) -> bool:
        return self._pipe.finished

    @property
    def error(self) -> GatewayError | None:
        return self._pipe.error

    @property
    def usage(self) -> TokenCounts:
        return self._pipe.counts

    @property
    def rejected_tool_calls(self):
        return self._pipe.rejected_tool_calls

    def push(self, token_ids: Sequence[int], finish: int | None = None, usage: Usage | None = None,
             logprobs: Logprobs | None = None) -> list[bytes]:
        was_finished = self._pipe.finished
        out = [self._frame(event, counts)
               for event, counts in self._pipe.push(token_ids, finish, usage, logprobs)]
        if self._pipe.finished and not was_finished:
            out += self._closing_frames()
        return out

    def fail(self, error: GatewayError) -> list[bytes]:
        """The frames that end the stream with `error` in the protocol's shape."""
        return self._closing_frames() if self._pipe.fail(error) else []

    def _closing_frames(self) -> list[bytes]:
        out = [self._error_frame(self._pipe.error)] if self._pipe.error is not None else []
        done = self._response_class.sse_done_data()
        if done is not None:
            out.append(f"data: {done}\n\n".encode())
        return out

    def _frame(self, event, counts: TokenCounts | None) -> bytes:
        data = self._pipe.render(event)
        if counts is not None and '"usage":{' in data:
            payload = json.loads(data)
            if patch_usage(payload, self._protocol, counts):
                data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        self._events_sent += 1
        name = self._response_class.sse_event_name(event)
        if name is None:
            return f"data: {data}\n\n".encode()
        return f"event: {name}\ndata: {data}\n\n".encode()

    def _error_frame(self, error: GatewayError) -> bytes:
        payload = error.payload(self._protocol)
        if self._protocol is Protocol.CHAT:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()
        if self._protocol is Protocol.RESPONSES:
            inner = payload["error"]
            payload = {"type": "error", "code": inner["code"], "message": inner["message"],
                       "param": inner["param"], "sequence_number": self._events_sent}
        return f"event: error\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class ResponseAccumulator:
    """Non-streaming response: push() as the tokens come, then body() gives the JSON body."""

    def __init__(self, spec: ResponseSpec, response_id: str | None = None) -> None:
        self._pipe = _Pipeline(spec, response_id or spec.new_id())
        self._protocol = spec.protocol
        self._response = _RESPONSE_CLASS[spec.protocol](
            self._pipe.response_id, spec.model, int(time.time()), spec.prompt_tokens, 0)

    @property
    def response_id(self) -> str:
        return self._pipe.response_id

    @property
    def finished(self) -> bool:
        return self._pipe.finished

    @property
    def usage(self) -> TokenCounts:
        return self._pipe.counts

    @property
    def rejected_tool_calls(self):
        return self._pipe.rejected_tool_calls

    def push(self, token_ids: Sequence[int], finish: int | None = None, usage: Usage | None = None,
             logprobs: Logprobs | None = None) -> list[bytes]:
        for event, _ in self._pipe.push(token_ids, finish, usage, logprobs):
            self._response.accumulate(event)
        return []

    def fail(self, error: GatewayError) -> list[bytes]:
        """End the response with `error`: body() raises it."""
        self._pipe.fail(error)
        return []

    def body(self) -> bytes:
        """The final JSON body; raises GatewayError if generation failed or never finished."""
        if self._pipe.error is not None:
            raise self._pipe.error
        if not self._pipe.finished:
            raise internal("the response is not complete yet")
        payload = json.loads(self._pipe.restore(self._response.to_json()))
        patch_usage(payload, self._protocol, self._pipe.counts)
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
