"""The gateway's HTTP API (aiohttp): OpenAI Chat Completions and Responses, Anthropic Messages,
/v1/models, /health, /metrics. Streaming answers are SSE; every error is in the protocol's shape.

/health is liveness; /ready says whether every pool behind the gateway has a live worker (readiness.py).

A request: authenticate -> admit (bounded) -> prepare in a thread (convert, render, encode) ->
GenerateRequest to the upstream -> chunks through the adapter's stream/accumulator -> the client.
A client that disconnects cancels its handler, which aborts the request (at its streaming worker
once known). A worker that dies under a request resumes it elsewhere (resume.py). Each request
writes one `request.summary` line, its chunk timings and resumes included.
"""
from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from messages import ErrorReply, WireError
from messages.common import FinishReason, TrafficClass
from messages.control import ServiceState
from messages.generate import GenerateChunk, GenerateRequest
from services.gateway.adapter import GatewayError, Protocol, traffic
from services.gateway.identity import model_unknown
from services.gateway.image_calls import resolve_images, send_generate, vision_groups
from services.gateway.grammar_calls import compile_failure, compile_message, no_compiler, pick_compiler
from services.gateway import readiness
from services.gateway.open_requests import OpenRequest
from services.gateway.resume import RESUMABLE, client_usage, resumed_request
from services.runtime.tracing import SpanContext, span_from


_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_UPSTREAM_STATUS = {"INVALID_REQUEST": 400, "DRAINING": 503, "PEER_DEAD": 502, "TIMEOUT": 504}


def too_busy(protocol: Protocol, why: str) -> GatewayError:
    """Overload: 429 for the OpenAI APIs, 529 (overloaded_error) for Anthropic."""
    if protocol.is_openai:
        return GatewayError(429, "rate_limit_error", why, code="overloaded")
    return GatewayError(529, "overloaded_error", why)


RETRY_AFTER_S = 1   # what an overloaded or draining answer tells clients to wait before trying again


def _error_response(protocol: Protocol, error: GatewayError) -> web.Response:
    status = error.status_for(protocol)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503, 529) else None
    return web.Response(status=status, body=error.body(protocol), content_type="application/json", headers=headers)


def _from_upstream(reply: ErrorReply, protocol: Protocol) -> GatewayError:
    from messages.errors import ErrorCode
    name = ErrorCode(reply.code).name if reply.code in ErrorCode._value2member_map_ else "INTERNAL"
    if name == "OVERLOADED":   # a router's queue is full or its deadline passed: retry later
        return too_busy(protocol, f"upstream: {reply.message}")
    status = _UPSTREAM_STATUS.get(name, 500)
    kind = {400: "invalid_request_error", 429: "overloaded_error", 503: "overloaded_error"}.get(status, "api_error")
    return GatewayError(status, kind, f"upstream: {reply.message}", code=name.lower())


def _logprobs(chunk: GenerateChunk):
    """The adapter's per-token (logprob, [(token id, logprob), ...]) from a worker chunk, or None."""
    if not chunk.logprobs:
        return None
    tops = chunk.top_logprobs or [[] for _ in chunk.logprobs]
    return [(lp, [(t.token_id, t.logprob) for t in top]) for lp, top in zip(chunk.logprobs, tops)]


@dataclass(slots=True, eq=False)
class Call:
    """One generate call, from admission to its summary line."""
    protocol: Protocol
    request_id: str
    span: SpanContext
    log: Any
    started: float
    prepared_at: float = 0.0
    phases: dict = field(default_factory=dict)
    traffic_class: TrafficClass = TrafficClass.CHATBOT
    prepared: Any = None               # adapter.PreparedRequest, once admitted
    tracked: OpenRequest | None = None
    response: Any = None               # its ResponseStream or ResponseAccumulator
    first_request: GenerateRequest | None = None
    grammar_call: asyncio.Future | None = None
    outcome: str = "ok"


class GatewayHttp:
    def __init__(self, service):
        self.svc = service
        self.active = 0

    # ---- plumbing ----------------------------------------------------------------------
    def authorised(self, request: web.Request) -> bool:
        keys = self.svc.settings.api_keys
        if not keys:
            return True
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)

    async def generate(self, request: web.Request, protocol: Protocol) -> web.StreamResponse:
        svc = self.svc
        if not self.authorised(request):
            return _error_response(protocol, GatewayError(401, "authentication_error", "invalid or missing API key"))
        if svc.state != ServiceState.RUNNING:
            return _error_response(protocol, GatewayError(503, "overloaded_error", "the gateway is shutting down"))
        if self.active >= svc.settings.max_concurrent_requests:
            svc.metrics.error("HTTP_OVERLOADED")
            return _error_response(protocol, too_busy(protocol, "too many requests in flight; retry later"))
        self.active += 1
        try:
            return await self._generate(request, protocol)
        finally:
            self.active -= 1

    async def _generate(self, request: web.Request, protocol: Protocol) -> web.StreamResponse:
        """admit (read, prepare, open) -> stream (send, relay chunks, resume) -> summarize (one line)."""
        call = self._open_call(request, protocol)
        refused = await self._admit(request, call)
        if refused is not None:
            return refused
        try:
            return await self._stream(request, call)
        except WireError as exc:   # the upstream could not take it (full queue, gone)
            call.outcome = exc.code.name.lower()
            return _error_response(protocol, too_busy(protocol, f"upstream unavailable: {exc.message}"))
        except (asyncio.CancelledError, ConnectionResetError):
            call.outcome = "client_disconnected"
            self.svc.abort(call.tracked, "client_disconnected")
            raise
        finally:
            if call.grammar_call is not None:
                call.grammar_call.cancel()
            self.svc.close_request(call.tracked)
            self._summarize(call)

    def _open_call(self, request: web.Request, protocol: Protocol) -> Call:
        given_id = request.headers.get("x-request-id", "")
        request_id = given_id if _REQUEST_ID.match(given_id) else f"req-{uuid.uuid4().hex}"
        span = span_from(request.headers.get("traceparent", ""))
        log = self.svc.log.bind(request_id=request_id, trace_id=span.trace_id, span_id=span.span_id)
        return Call(protocol, request_id, span, log, started=time.time())

    async def _admit(self, request: web.Request, call: Call) -> web.Response | None:
        """Read, prepare (and resolve images), pick a compiler, open the request: None when it may go
        on, else the refusal to answer (no summary line: nothing was sent upstream)."""
        svc, protocol = self.svc, call.protocol
        try:
            header = traffic.header_class(request.headers.get(traffic.HEADER))
            body = await request.read()
            prepared, hashes = await asyncio.get_running_loop().run_in_executor(svc.pool, svc.prepare, protocol, body)
            if prepared.image_sources:
                images_started = time.time()
                prepared, hashes = await resolve_images(svc, prepared)
                # fetch, decode and sizing of the request's images (included in prepare_ms)
                call.phases["images_ms"] = round((time.time() - images_started) * 1e3, 3)
                call.phases["images"] = len(prepared.images)
            call.traffic_class = traffic.resolved_class(header, prepared.traffic_class, prepared.traffic_named)
        except web.HTTPRequestEntityTooLarge:
            return _error_response(protocol, GatewayError(413, "request_too_large", "request body too large"))
        except GatewayError as exc:
            call.log.info("request.rejected", status=exc.status_for(protocol), error=exc.message)
            return _error_response(protocol, exc)
        call.prepared_at = time.time()
        call.phases = {"prepare_ms": round((call.prepared_at - call.started) * 1e3, 3), **call.phases}
        if call.request_id in svc.pending:   # a client reused an id still in flight: keep both apart
            call.request_id = f"{call.request_id}-{uuid.uuid4().hex[:8]}"
            call.log = call.log.bind(request_id=call.request_id)
        compiler = pick_compiler(svc, prepared.grammar.key) if prepared.grammar is not None else ""
        if prepared.grammar is not None and not compiler:
            call.log.info("request.rejected", status=503, error="no grammar compiler")
            return _error_response(protocol, no_compiler())
        if (unknown := model_unknown(svc, prepared.prompt_ids)) is not None:   # no worker registered yet
            call.log.info("request.rejected", status=503, error="model identity unknown")
            return _error_response(protocol, unknown)
        call.prepared, call.tracked = prepared, svc.open_request(call.request_id, call.span)
        call.response = prepared.open_response()
        call.first_request = prepared.generate_request(
            return_address=svc.config.advertise, arrival_time=call.started, block_hashes=hashes,
            traffic_class=int(call.traffic_class), vision_groups=vision_groups(svc) if prepared.images else [])
        if compiler:   # compiled while the request is routed and its prefix loaded (grammar_calls.py)
            call.first_request.grammar = msgspec.structs.replace(call.first_request.grammar, compiler=compiler)
            call.grammar_call = asyncio.ensure_future(svc.call(
                compiler, compile_message(call.first_request.grammar), request_id=call.request_id, span=call.span,
                timeout=svc.settings.grammar_timeout_s))
        return None

    async def _stream(self, request: web.Request, call: Call) -> web.StreamResponse:
        """Send the request, then relay its chunks to the client (resuming where a worker died)."""
        svc, protocol, tracked, response = self.svc, call.protocol, call.tracked, call.response
        send_generate(svc, call.first_request, call.request_id, call.span)
        if call.grammar_call is not None:
            failed = await self._grammar_failure(call.grammar_call, call.log)
            call.grammar_call, call.phases["grammar_ms"] = None, round((time.time() - call.prepared_at) * 1e3, 3)
            if failed is not None:
                call.outcome = failed.code or "grammar_error"
                svc.abort(tracked, call.outcome)
                return _error_response(protocol, failed)
        http, timeout = None, svc.settings.first_chunk_timeout_s
        while True:
            item = await self._next(tracked, timeout, protocol)
            if isinstance(item, GatewayError) and item.code in RESUMABLE:
                if item.code != "worker_died" and tracked.worker:   # a router's news of the prefill rank, but
                    call.log.info("request.failure_ignored", cause=item.code, worker=tracked.worker)   # a worker
                    continue                                        # streams it already (watched on its own)
                if tracked.attempt < svc.settings.max_resumes and await self._resume(
                        tracked, call.first_request, item, call.log):
                    timeout = svc.settings.first_chunk_timeout_s
                    continue
            if isinstance(item, GatewayError):   # failed: end in the protocol's shape
                call.outcome = item.code or "error"
                svc.abort(tracked, call.outcome)   # wherever it still waits or runs: free it there
                if http is None:
                    return _error_response(protocol, item)
                frames = response.fail(item)
            else:
                tracked.token_ids.extend(item.token_ids)
                usage = client_usage(item.usage, len(call.prepared.prompt_ids), tracked.streamed_before)
                frames = response.push(item.token_ids, item.finish_reason or None, usage, _logprobs(item))
                if call.prepared.stream and http is None:
                    http = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache", "x-request-id": call.request_id})
                    await http.prepare(request)
            if http is not None:
                for frame in frames:
                    await http.write(frame)
            if response.finished:
                if isinstance(item, GenerateChunk) and not item.finish_reason:   # EOS / stop sequence
                    svc.abort(tracked, "stopped_by_gateway")                   # seen here: stop the worker
                break
            timeout = svc.settings.chunk_timeout_s
        if http is not None:
            await http.write_eof()
            return http
        try:
            body_out = response.body()
        except GatewayError as exc:
            call.outcome = exc.code or "error"
            return _error_response(protocol, exc)
        return web.Response(body=body_out, content_type="application/json", headers={"x-request-id": call.request_id})

    @staticmethod
    def _summarize(call: Call) -> None:
        """The request's one `request.summary` line (epd trace reads it)."""
        usage = call.response.usage
        call.log.info("request.summary", type=call.protocol.value, sender="http", start=call.started,
                      handle_ms=round((time.time() - call.started) * 1e3, 3), phases=call.phases,
                      **call.tracked.stats.fields(call.started), worker=call.tracked.worker or None,
                      resumes=call.tracked.attempt or None, prompt_tokens=usage.prompt, cached_tokens=usage.cached,
                      completion_tokens=usage.completion, stream=call.prepared.stream,
                      traffic_class=call.traffic_class.name.lower(), outcome=call.outcome)

    @staticmethod
    async def _grammar_failure(call: asyncio.Future, log) -> GatewayError | None:
        """None when the constraint compiled; else the client's error for it."""
        try:
            reply = await call
        except WireError as exc:
            log.info("request.grammar_failed", code=exc.code.name, error=exc.message)
            return compile_failure(exc)
        compiled = reply.message
        log.debug("request.grammar_compiled", key=compiled.key, compile_ms=compiled.compile_ms, cached=compiled.cached)
        return None

    async def _resume(self, tracked, first_request, cause: GatewayError, log) -> bool:
        """Send the request's next attempt (resume.py); False if it cannot go (then `cause` stands)."""
        svc = self.svc
        generated = tracked.token_ids
        if len(generated) >= first_request.sampling.max_tokens:
            return False
        upstream = svc.upstream
        if upstream is not None and not upstream.connected:   # the router restarts: wait for it, bounded
            try:
                await asyncio.wait_for(upstream.ready.wait(), svc.settings.resume_timeout_s)
            except asyncio.TimeoutError:
                return False
        if cause.code == "worker_died" and tracked.worker and tracked.worker not in tracked.dead_workers:
            tracked.dead_workers.append(tracked.worker)   # the router's view may still hold it for seconds
        wire = svc.next_attempt(tracked)
        log.warning("request.resumed", attempt=tracked.attempt, wire_id=wire, cause=cause.code,
                    error=cause.message, tokens_streamed=len(generated))
        attempt = resumed_request(first_request, generated, svc.model_id)
        if attempt.grammar is not None:   # the compiler named first may be the process that died
            attempt.grammar.compiler = pick_compiler(svc, attempt.grammar.key) or attempt.grammar.compiler
        attempt.avoid_workers = list(tracked.dead_workers)
        if attempt.images:   # so may a vision group
            attempt.vision_groups = vision_groups(svc) or attempt.vision_groups
        try:
            send_generate(svc, attempt, wire, tracked.span)
        except WireError as exc:
            log.warning("request.resume_failed", attempt=tracked.attempt, code=exc.code.name)
            return False
        return True

    async def _next(self, tracked, timeout_s: float, protocol: Protocol):
        """The current attempt's next chunk, or a GatewayError for an upstream error, silence or a
        dead worker. What an older attempt sent is dropped (and stopped where it runs)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                wire, item = await asyncio.wait_for(tracked.queue.get(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return GatewayError(504, "api_error", f"no tokens from the worker for {timeout_s:.0f}s",
                                    code="timeout")
            if wire == tracked.wire_id:
                break
        if isinstance(item, GatewayError):
            return item
        if isinstance(item, GatewayError):
            return item
        if isinstance(item, ErrorReply):
            return _from_upstream(item, protocol)
        if item.finish_reason == FinishReason.ERROR and item.error and not item.token_ids:
            return GatewayError(502, "api_error", item.error, code="upstream_error")
        return item

    # ---- routes ------------------------------------------------------------------------
    async def chat(self, request):
        return await self.generate(request, Protocol.CHAT)

    async def responses(self, request):
        return await self.generate(request, Protocol.RESPONSES)

    async def messages(self, request):
        return await self.generate(request, Protocol.MESSAGES)

    async def models(self, request):
        if not self.authorised(request):
            return _error_response(Protocol.CHAT, GatewayError(401, "authentication_error", "invalid or missing API key"))
        created = int(self.svc.started_at)
        data = [{"id": name, "object": "model", "created": created, "owned_by": "epd",
                 "type": "model", "display_name": name,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}
                for name in self.svc.adapter.model_names]
        return web.json_response({"object": "list", "data": data, "has_more": False,
                                  "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None})

    async def health(self, request):
        svc = self.svc
        ok = svc.state == ServiceState.RUNNING and bool(svc.upstream and svc.upstream.connected)
        return web.json_response({"status": "ok" if ok else "unavailable",
                                  "state": ServiceState(svc.state).name.lower(),
                                  "upstream_connected": bool(svc.upstream and svc.upstream.connected),
                                  "in_flight": len(svc.pending)}, status=200 if ok else 503)

    async def ready(self, request):
        """Readiness (probes): 200 when every pool behind the gateway has a live worker, else 503
        naming the pools that are not ready and why (readiness.py)."""
        found = await readiness.pools(self.svc)
        missing = readiness.not_ready(found)
        return web.json_response({"status": "not_ready" if missing else "ready", "pools": found,
                                  "not_ready": sorted(missing)}, status=503 if missing else 200)

    async def metrics(self, request):
        return web.Response(body=self.svc.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_http(service) -> web.AppRunner:
    api = GatewayHttp(service)
    app = web.Application(client_max_size=service.settings.max_body_bytes)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/responses", api.responses)
    app.router.add_post("/v1/messages", api.messages)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/ready", api.ready)
    app.router.add_get("/metrics", api.metrics)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    host, _, port = service.settings.http_bind.rpartition(":")
    await web.TCPSite(runner, host or "127.0.0.1", int(port)).start()
    return runner
