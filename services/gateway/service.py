"""The gateway service: the HTTP front (aiohttp, http_app.py) plus its ZeroMQ side.

It sends each GenerateRequest to its upstream (the unified worker now; the prefill router in the
E/P/D topology) and receives the request's GenerateChunk messages on its own inbox, addressed to
it by `return_address`. It registers with the upstream and heartbeats, so each side learns when
the other dies: the worker frees a dead gateway's requests; the gateway fails its open requests
with a typed error when the upstream goes silent.
"""
from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from messages import ErrorReply
from messages.common import FinishReason
from messages.generate import GenerateChunk
from services.runtime.context import Context
from services.runtime.service import Service

DEFAULTS = {
    "http_bind": "127.0.0.1:8000",
    "model_dir": "",                 # tokenizer.json and config.json of the served model
    "dtype": "",                     # the workers' dtype (part of the block-hash model identity); "" = the model's
    "served_model": "deepseek-v4-tiny",
    "context_length": 0,             # 0 = the model's max_position_embeddings
    "max_output_tokens": 0,          # 0 = context_length
    "max_concurrent_requests": 256,  # more in flight answers 429 (OpenAI) / 529 (Anthropic)
    "max_body_bytes": 32 << 20,
    "api_keys": [],                  # empty = no authentication; also EPD_API_KEYS (comma separated)
    "tokenize_threads": 2,
    "first_chunk_timeout_s": 600.0,  # no token for this long: the request fails (504)
    "chunk_timeout_s": 120.0,
}


@dataclass(slots=True)
class GatewaySettings:
    http_bind: str
    model_dir: str
    dtype: str
    served_model: str
    context_length: int
    max_output_tokens: int
    max_concurrent_requests: int
    max_body_bytes: int
    api_keys: list
    tokenize_threads: int
    first_chunk_timeout_s: float
    chunk_timeout_s: float

    @classmethod
    def from_settings(cls, settings: dict) -> "GatewaySettings":
        unknown = set(settings) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown gateway settings: {sorted(unknown)}")
        values = {**DEFAULTS, **settings}
        env_keys = os.environ.get("EPD_API_KEYS", "")
        if env_keys:
            values["api_keys"] = [*values["api_keys"], *(k.strip() for k in env_keys.split(",") if k.strip())]
        out = cls(**values)
        if out.max_concurrent_requests < 1 or out.tokenize_threads < 1:
            raise ValueError("max_concurrent_requests and tokenize_threads must be >= 1")
        return out


class GatewayService(Service):
    kind = "gateway"

    def __init__(self, config):
        super().__init__(config)
        self.settings = GatewaySettings.from_settings(config.settings)
        self.pending: dict[str, asyncio.Queue] = {}   # request id -> chunks (or errors) for its handler
        self.adapter = None
        self.model_id = ""   # covered by every block hash; equal to the workers' engine model_id
        self.pool: ThreadPoolExecutor | None = None
        self.http_runner = None
        if not config.upstream:
            raise ValueError("the gateway needs an upstream (a unified worker or the prefill router)")

    def handlers(self):
        return {GenerateChunk: self._on_chunk, ErrorReply: self._on_error}

    def in_flight(self) -> int:
        return super().in_flight() + len(self.pending)

    async def on_start(self) -> None:
        from services.gateway.adapter import Adapter, AdapterConfig, ServedModel
        from services.gateway.http_app import start_http
        s = self.settings
        context = s.context_length or _model_context(s.model_dir)
        tokenizer = str(Path(s.model_dir) / "tokenizer.json") if s.model_dir else ""
        model = ServedModel(s.served_model, context_length=context, tokenizer_path=tokenizer,
                            max_output_tokens=s.max_output_tokens)
        loop = asyncio.get_running_loop()
        self.adapter = await loop.run_in_executor(
            None, Adapter, AdapterConfig(models=(model,), max_body_bytes=s.max_body_bytes))
        if s.model_dir:
            from engine.model_identity import configured_dtype, model_identity
            self.model_id = model_identity(s.model_dir, s.dtype or configured_dtype(s.model_dir))
        self.pool = ThreadPoolExecutor(s.tokenize_threads, thread_name_prefix="tokenize")
        self.http_runner = await start_http(self)
        self.log.info("gateway.listening", http=f"http://{s.http_bind}", model=s.served_model, model_id=self.model_id,
                      context_length=context, upstream=self.config.upstream)

    async def on_stop(self) -> None:
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- chunks from the upstream --------------------------------------------------------
    async def _on_chunk(self, msg: GenerateChunk, ctx: Context) -> None:
        queue = self.pending.get(ctx.request_id)
        if queue is None:   # finished or abandoned here; the worker learns from our abort
            self.log.debug("chunk.orphan", request_id=ctx.request_id)
            return
        queue.put_nowait(msg)

    async def _on_error(self, msg: ErrorReply, ctx: Context) -> None:
        queue = self.pending.get(ctx.request_id)
        if queue is not None:
            queue.put_nowait(msg)
        else:
            self.log.warning("upstream.error", request_id=ctx.request_id or None, code=msg.code,
                             error=msg.message)

    def prepare(self, protocol, body: bytes):
        """Convert, render, encode (adapter), then the prompt's block hash chain. Runs in the pool."""
        from engine.kv.prefix_hash import block_hashes
        prepared = self.adapter.prepare(protocol, body)
        hashes = block_hashes(self.model_id, prepared.prompt_ids) if self.model_id else []
        return prepared, hashes

    def on_upstream_lost(self) -> None:
        """The upstream stopped answering heartbeats: nothing will arrive for open requests."""
        for request_id, queue in self.pending.items():
            queue.put_nowait(GenerateChunk([], int(FinishReason.ERROR), error="upstream worker is unreachable"))
            self.log.warning("request.upstream_lost", request_id=request_id)


def _model_context(model_dir: str) -> int:
    if not model_dir:
        raise ValueError("gateway: set settings.model_dir (or settings.context_length)")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)
