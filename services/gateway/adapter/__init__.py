"""The gateway's pure protocol adapter on deepseek-recipe (no sockets, no aiohttp).

What the HTTP app calls:

    adapter = Adapter(AdapterConfig(models=(ServedModel("deepseek-v4-tiny", context_length=8192),)))
    try:
        prepared = await loop.run_in_executor(pool, adapter.prepare, Protocol.CHAT, body)
    except GatewayError as e:
        return web.Response(status=e.status_for(protocol), body=e.body(protocol),
                            content_type="application/json")
    send(prepared.generate_request(return_address=..., block_hashes=...))
    response = prepared.open_response(request_id)   # ResponseStream if prepared.stream
    for chunk in worker chunks:                        # GenerateChunk
        frames = response.push(chunk.token_ids, chunk.finish_reason, chunk.usage)
        write each frame (stream); if response.finished and not chunk.finish_reason: abort worker
    non-stream: response.body() (raises GatewayError if generation failed)
"""
from services.gateway.adapter.config import AdapterConfig, ServedModel, packaged_v4_tokenizer
from services.gateway.adapter.errors import GatewayError, Protocol, from_library_error
from services.gateway.adapter.images import destination_filter, is_public_address, safe_image_fetcher
from services.gateway.adapter.prepare import Adapter, PreparedRequest
from services.gateway.adapter.response import ResponseAccumulator, ResponseStream
from services.gateway.adapter.usage import TokenCounts

__all__ = [
    "Adapter", "AdapterConfig", "ServedModel", "packaged_v4_tokenizer",
    "GatewayError", "Protocol", "from_library_error",
    "PreparedRequest", "ResponseStream", "ResponseAccumulator", "TokenCounts",
    "safe_image_fetcher", "destination_filter", "is_public_address",
]
