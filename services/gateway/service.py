"""The gateway service: the HTTP front (aiohttp, http_app.py) plus its ZeroMQ side.

It sends each GenerateRequest to its upstream (the prefill router in the E/P/D topology; the
unified worker) and receives the request's GenerateChunk messages on its own inbox, addressed to
it by `return_address`. The first chunk names the worker that streams the request: aborts go
straight there, and the gateway watches that worker (worker_watch.py). The prefill worker's early
first token names no worker; numbered chunks show each token once (OpenRequest.take). A chunk for a
request it no longer holds gets AbortRequest("abandoned") back at once, so no worker generates for nobody. It
registers with the upstream and heartbeats: the worker frees a dead gateway's requests; the
gateway fails the requests still on their way to a worker when the upstream goes silent. The model
identity its block hashes carry comes from the upstream's answers, never from a setting (identity.py).
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from messages import ErrorReply, WireError
from messages.generate import AbortRequest, GenerateChunk
from services.gateway.open_requests import OpenRequest, StreamGap
from services.runtime.context import Context
from services.runtime.service import Service
from services.runtime.settings import parse_settings
from services.runtime.tracing import SpanContext

@dataclass(slots=True, frozen=True)
class GatewaySettings:
    http_bind: str = "127.0.0.1:8000"
    model_dir: str = ""                  # tokenizer.json and config.json of the served model
    served_model: str = ""            # the API's model name; "" = the model directory's name
    encoding: str = ""                   # "" = the model dir's (config.json model_type); "v4" | "v4.1"
                                         # must agree with the model dir (checked at start)
    context_length: int = 0              # 0 = the model's max_position_embeddings
    max_output_tokens: int = 0           # 0 = context_length
    max_concurrent_requests: int = 256   # more in flight answers 429 (OpenAI) / 529 (Anthropic)
    max_body_bytes: int = 32 << 20
    api_keys: tuple[str, ...] = ()       # empty = no authentication; also EPD_API_KEYS (comma separated)
    tokenize_threads: int = 2
    first_chunk_timeout_s: float = 600.0   # no token for this long: the request fails (504)
    chunk_timeout_s: float = 120.0
    max_resumes: int = 3                  # attempts after the first when a worker dies (resume.py)
    resume_timeout_s: float = 30.0        # how long a resume waits for the upstream to come back
    grammar_timeout_s: float = 15.0       # a constraint's compile answer (the compiler's own hard limit is
                                          # 10 s by default): past this the request fails 503
    # Images (a model with a vision encoder; services/gateway/vision/): every URL is fetched SSRF-safe.
    image_max_bytes: int = 20 << 20       # one image, fetched or inline
    image_fetch_timeout_s: float = 10.0   # one fetch, redirects included
    image_max_pixels: int = 50_000_000    # checked from the header before decoding
    max_images: int = 16                  # per request
    image_allow_networks: tuple[str, ...] = ()   # CIDRs fetched although not public (an internal image store)
    aides: tuple[str, ...] = ()           # kinds the topology runs for this gateway (grammar_compiler,
                                          # vision_balancer): /ready waits for each (readiness.py)

    def __post_init__(self) -> None:
        if self.encoding not in ("", "v4", "v4.1"):
            raise ValueError(f"encoding must be '', 'v4' or 'v4.1', got {self.encoding!r}")
        if self.max_concurrent_requests < 1 or self.tokenize_threads < 1:
            raise ValueError("max_concurrent_requests and tokenize_threads must be >= 1")
        if not set(self.aides) <= {"grammar_compiler", "vision_balancer"}:
            raise ValueError(f"aides may name grammar_compiler and vision_balancer, got {list(self.aides)}")
        if self.max_resumes < 0 or self.resume_timeout_s <= 0:
            raise ValueError("max_resumes must be >= 0 and resume_timeout_s > 0")
        if not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        env_keys = os.environ.get("EPD_API_KEYS", "")
        if env_keys:
            keys = (*self.api_keys, *(k.strip() for k in env_keys.split(",") if k.strip()))
            object.__setattr__(self, "api_keys", keys)


class GatewayService(Service):
    kind = "gateway"
    streamed_types = (GenerateChunk, ErrorReply)   # parts of a request: http_app writes its one summary
    continuation_types = (GenerateChunk, ErrorReply)   # a draining gateway still finishes the streams it holds

    def __init__(self, config):
        super().__init__(config)
        if "dtype" in config.settings:
            raise ValueError("gateway: settings.dtype is gone: the gateway learns the model identity from the "
                             "workers as they register; the dtype is the topology's [model] table's")
        self.settings = parse_settings(GatewaySettings, config.settings, self.kind)
        self.pending: dict[str, OpenRequest] = {}   # wire id (resume.py) -> what its HTTP handler waits on
        self.adapter = None
        self.loop: asyncio.AbstractEventLoop | None = None   # where prepare's pool threads ask the upstream
        self.pool: ThreadPoolExecutor | None = None
        self.images = None   # ImageResolver, when the served model has a vision encoder
        self.http_runner = None
        if not config.upstream:
            raise ValueError("the gateway needs an upstream (a unified worker or the prefill router)")

    def handlers(self):
        return {GenerateChunk: self._on_chunk, ErrorReply: self._on_error}

    def in_flight(self) -> int:
        return super().in_flight() + len(self.pending)

    @property
    def model_id(self) -> str:
        """The workers' model identity, as the upstream last named it ("" = none registered yet)."""
        return self.upstream.model_id if self.upstream is not None else ""

    async def on_start(self) -> None:
        from services.gateway.adapter import Adapter, AdapterConfig, ServedModel
        from services.gateway.http_app import start_http
        from services.gateway.model_dir import context_length, served_encoding, vision_sizing
        from services.gateway.vision import ImageFetcher, ImageLimits, ImageResolver
        from services.gateway.worker_watch import watch_workers
        s = self.settings
        context = s.context_length or context_length(s.model_dir)
        encoding = served_encoding(s.model_dir, s.encoding)
        tokenizer = str(Path(s.model_dir) / "tokenizer.json") if s.model_dir else ""
        served = s.served_model or (Path(s.model_dir).name if s.model_dir else "deepseek-v4-tiny")  # no dir: V4 tokenizer
        model = ServedModel(served, context_length=context, encoding=encoding,
                            tokenizer_path=tokenizer, max_output_tokens=s.max_output_tokens)
        loop = asyncio.get_running_loop()
        sizing = vision_sizing(s.model_dir)
        self.adapter = await loop.run_in_executor(
            None, Adapter, AdapterConfig(models=(model,), max_body_bytes=s.max_body_bytes,
                                         accept_images=sizing is not None))
        if sizing is not None:
            limits = ImageLimits(max_bytes=s.image_max_bytes, total_timeout_s=s.image_fetch_timeout_s,
                                 max_pixels=s.image_max_pixels, max_images=s.max_images,
                                 allow_networks=tuple(s.image_allow_networks))
            self.images = ImageResolver(ImageFetcher(limits), sizing)
        self.loop = loop
        self.pool = ThreadPoolExecutor(s.tokenize_threads, thread_name_prefix="tokenize")
        self.http_runner = await start_http(self)
        self.in_background(watch_workers(self), "worker_watch.failed")
        self.log.info("gateway.listening", http=f"http://{s.http_bind}", model=served,
                      encoding=encoding, context_length=context, upstream=self.config.upstream)

    async def on_stop(self) -> None:
        from services.gateway.adapter.errors import OVERLOADED, GatewayError
        for request in list(self.pending.values()):   # the grace period ran out: a clear error, not a cut connection
            request.put(GatewayError(503, OVERLOADED, "the gateway stopped before the answer was complete; retry",
                                     code="shutting_down"))
        if self.http_runner is not None:
            await self.http_runner.cleanup()   # the handlers write those errors, then end
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.images is not None:
            await self.images.fetcher.close()

    # ---- requests and their chunks -------------------------------------------------------
    def open_request(self, request_id: str, span: SpanContext) -> OpenRequest:
        self.pending[request_id] = OpenRequest(request_id, span)
        return self.pending[request_id]

    def next_attempt(self, request: OpenRequest) -> str:
        """Move `request` to its next attempt's wire id: whatever the older attempt still sends is
        an orphan from now on (answered with an abort, never shown to the client)."""
        from services.gateway.resume import wire_id
        self.pending.pop(request.wire_id, None)
        request.attempt += 1
        request.streamed_before, request.received = len(request.token_ids), 0
        request.wire_id = wire_id(request.request_id, request.attempt)
        request.worker = request.worker_incarnation = ""
        self.pending[request.wire_id] = request
        return request.wire_id

    def close_request(self, request: OpenRequest) -> None:
        self.pending.pop(request.wire_id, None)

    def abort(self, request: OpenRequest, reason: str) -> None:
        """Stop an open request: at the worker that streams it when known, else at the upstream."""
        if self.pending.get(request.wire_id) is not request:
            return
        try:
            self.send(request.worker or self.config.upstream, AbortRequest(reason), request_id=request.wire_id,
                      span=request.span)
        except WireError as exc:
            self.log.warning("abort.undeliverable", request_id=request.wire_id, code=exc.code.name)

    async def _on_chunk(self, msg: GenerateChunk, ctx: Context) -> None:
        request = self.pending.get(ctx.request_id)
        if request is None:   # finished or abandoned here: stop its worker now
            self.log.debug("chunk.orphan", request_id=ctx.request_id, sender=ctx.sender)
            if ctx.request_id:
                try:
                    ctx.reply(AbortRequest("abandoned"))
                except WireError as exc:
                    self.log.warning("abort.undeliverable", request_id=ctx.request_id, code=exc.code.name)
            return
        if msg.worker:
            request.worker, request.worker_incarnation = msg.worker, msg.worker_incarnation
        try:
            msg = request.take(msg)   # a token already here (the prefill's first, again) is dropped
        except StreamGap as exc:
            from services.gateway.adapter.errors import API_ERROR, GatewayError
            self.log.warning("chunk.gap", request_id=ctx.request_id, sender=ctx.sender, error=str(exc))
            request.put(GatewayError(502, API_ERROR, f"the stream lost tokens: {exc}", code="stream_gap"))
            return
        if msg is None:
            return
        request.stats.add(ctx.received_at, len(msg.token_ids))
        request.queue.put_nowait((ctx.request_id, msg))

    async def _on_error(self, msg: ErrorReply, ctx: Context) -> None:
        request = self.pending.get(ctx.request_id)
        if request is not None:
            request.queue.put_nowait((ctx.request_id, msg))
        else:
            self.log.warning("upstream.error", request_id=ctx.request_id or None, code=msg.code,
                             error=msg.message)

    def prepare(self, protocol, body: bytes):
        """Convert, render, encode (adapter), then the prompt's block hash chain (identity.py).
        Runs in the pool."""
        from services.gateway.identity import prompt_hashes_from_thread
        prepared = self.adapter.prepare(protocol, body)
        if prepared.image_sources:   # hashed once the images are resolved (image_calls.py)
            return prepared, []
        return prepared, prompt_hashes_from_thread(self, self.loop, prepared.prompt_ids)

    def on_upstream_lost(self) -> None:
        """The upstream stopped answering: requests not yet streaming from a worker (watched on its
        own, worker_watch.py) may be lost with it; each is resumed once the upstream is back."""
        from services.gateway.adapter.errors import API_ERROR, GatewayError
        for request in list(self.pending.values()):
            if not request.worker:
                request.put(GatewayError(502, API_ERROR, "the upstream router stopped answering",
                                         code="upstream_lost"))
                self.log.warning("request.upstream_lost", request_id=request.wire_id)
