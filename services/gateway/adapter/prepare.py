"""Protocol in: request body bytes -> PreparedRequest (prompt ids, sampling, response factory).

`Adapter.prepare` is synchronous and pure (no sockets); its expensive part, prompt encoding, runs in
deepseek-recipe's Rust code with the GIL released, so the gateway calls it in a thread executor.
Every failure is a `GatewayError`, rendered by the caller with `error.body(protocol)`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
from deepseek_recipe import (
    ChatCompletionRequest, ConversationRequest, ConversionError, MessagesRequest, ResponsesRequest,
)

from messages.common import SamplingParams, TrafficClass
from messages.generate import GenerateRequest
from messages.grammar import GrammarRef, constraint_json, constraint_key
from services.gateway.adapter import request_checks, unenforced
from services.gateway.adapter.config import AdapterConfig
from services.gateway.adapter.constraints import constraint_of
from services.gateway.adapter.errors import (
    GatewayError, Protocol, from_library_error, internal, invalid_request, request_too_large,
)
from services.gateway.adapter.models import V41_IMAGE_TOKEN, ModelRuntime, load_models
from services.gateway.adapter.parsing import output_parsing_for
from services.gateway.adapter.request_checks import RequestedSampling
from services.gateway.adapter.response import ResponseAccumulator, ResponseSpec, ResponseStream
from services.gateway.adapter.thinking import requested_budget, thinking_params
from services.gateway.adapter.traffic import body_class
from services.gateway.vision.sources import image_part_paths, sources_of

_REQUEST_CLASS = {Protocol.CHAT: ChatCompletionRequest, Protocol.RESPONSES: ResponsesRequest,
                  Protocol.MESSAGES: MessagesRequest}
_PROMPT_PARAM = {Protocol.CHAT: "messages", Protocol.RESPONSES: "input", Protocol.MESSAGES: "messages"}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    protocol: Protocol
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    context_length: int
    stop_sequences: tuple[str, ...]
    grammar: GrammarRef | None        # the output constraint (constraints.py); the gateway names its compiler
    response: ResponseSpec
    # Images still to resolve ((kind, value, path), services/gateway/vision, in placeholder order): the gateway
    # fetches and sizes them, then `Adapter.with_images` writes their spans into prompt_ids.
    image_sources: tuple = ()
    images: tuple = ()                # messages.images.ImageInput, once resolved
    traffic_class: TrafficClass = TrafficClass.CHATBOT   # from metadata.traffic_class, else by its tools (traffic.py)
    traffic_named: bool = False       # whether the body named it (a header naming another is refused)

    def open_stream(self, response_id: str | None = None) -> ResponseStream:
        return ResponseStream(self.response, response_id)

    def open_accumulator(self, response_id: str | None = None) -> ResponseAccumulator:
        return ResponseAccumulator(self.response, response_id)

    def open_response(self, response_id: str | None = None) -> ResponseStream | ResponseAccumulator:
        """The stream for a streaming request, the accumulator otherwise."""
        return self.open_stream(response_id) if self.stream else self.open_accumulator(response_id)

    def generate_request(self, **fields) -> GenerateRequest:
        """The worker message; pass block_hashes, return_address, traffic_class... as fields."""
        if self.image_sources:
            raise ValueError("resolve the request's images first (Adapter.with_images)")
        return GenerateRequest(model=self.model, prompt_ids=self.prompt_ids, sampling=self.sampling,
                               grammar=self.grammar, images=list(self.images), **fields)


class Adapter:
    """The gateway's pure core: one per process, shared by all requests and threads."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self._models: dict[str, ModelRuntime] = load_models(config)
        self._served = set(self._models)

    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.config.models]

    def prepare(self, protocol: Protocol, body: bytes) -> PreparedRequest:
        """Parse, check, convert, render and encode one request. Raises GatewayError."""
        if len(body) > self.config.max_body_bytes:
            raise request_too_large(f"request body is {len(body)} bytes; the limit is "
                                    f"{self.config.max_body_bytes}")
        try:
            payload = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise invalid_request(f"invalid JSON body: {exc}", code="invalid_json") from None
        model = request_checks.requested_model(protocol, payload, self._served)
        runtime = self._models[model]
        if request_checks.normalise(protocol, payload):
            body = msgspec.json.encode(payload)
        unenforced.refuse_images(protocol, payload, self.config.accept_images)
        requested = replace(request_checks.requested_sampling(payload),
                            thinking_budget=requested_budget(protocol, payload))
        echo, namespace_tools = None, {}
        try:
            library_request = _REQUEST_CLASS[protocol](body)
            if protocol is Protocol.RESPONSES:
                echo = library_request.echo()
                namespace_tools = library_request.namespace_tool_map(runtime.options)
            converted = library_request.convert(runtime.options)
        except (ConversionError, ValueError, TypeError) as exc:
            raise from_library_error(exc) from None
        return self._finish(protocol, model, runtime, converted, requested, echo, namespace_tools, payload)

    def prepare_conversation(self, protocol: Protocol, model: str,
                             request: ConversationRequest) -> PreparedRequest:
        """Prepare a hand-built ConversationRequest (its parsing options are repaired)."""
        if model not in self._served:
            raise request_checks.model_not_found(protocol, model, self._served)
        return self._finish(protocol, model, self._models[model], request, RequestedSampling(), None, {}, None)

    # -- shared tail -------------------------------------------------------------------------

    def _finish(self, protocol: Protocol, model: str, runtime: ModelRuntime,
                converted: ConversationRequest, requested: RequestedSampling, echo,
                namespace_tools, payload: dict | None) -> PreparedRequest:
        conversation = converted.conversation
        if not conversation.messages:
            raise invalid_request("the request has no message to answer",
                                  param=_PROMPT_PARAM[protocol])
        image_sources = ()
        if any(m.image_sources for m in conversation.messages):
            key = _PROMPT_PARAM[protocol]
            image_sources = tuple(sources_of(conversation, None if payload is None else
                                             image_part_paths(payload.get(key), key)))
            refuse_image_detail(conversation, image_sources)
        if image_sources and not self.config.accept_images:
            raise invalid_request("image inputs are not supported: the served model has no vision encoder",
                                  param=_PROMPT_PARAM[protocol], code="unsupported_content")
        if payload is None:   # a hand-built request has no body to read its constraint from
            unenforced.refuse_converted(conversation, converted.inference_options.output_constraint)
        try:
            prompt_ids = runtime.encoding.encode(conversation)
        except (RuntimeError, ValueError) as exc:
            raise internal(f"prompt encoding failed: {exc}") from None
        context = runtime.served.context_length
        max_tokens = self._max_tokens(protocol, converted, len(prompt_ids), context)
        options = converted.inference_options
        parsing = output_parsing_for(converted)
        grammar = None if payload is None else _grammar_ref(runtime, constraint_of(protocol, payload, parsing), parsing)
        budget, think_end = thinking_params(requested.thinking_budget, options.max_tokens, parsing,
                                            runtime.table.added_ids)
        # The request's own values first: in thinking mode the library resolves temperature and
        # top_p to its recommended 1.0 / 0.95 whatever was asked, so temperature 0 was not greedy.
        sampling = SamplingParams(
            temperature=_or(requested.temperature, _or(options.temperature, 1.0)),
            top_p=_or(requested.top_p, _or(options.top_p, 1.0)), top_k=requested.top_k,
            seed=_or(options.seed, requested.seed), max_tokens=max_tokens, stop_token_ids=[runtime.eos_id],
            logprobs=options.logprobs, top_logprobs=_or(options.top_logprobs, 0),
            thinking_budget=budget, think_end_id=think_end)
        tools = payload.get("tools") if payload is not None else conversation.tools
        traffic, named = body_class(payload, bool(tools))
        spec = ResponseSpec(
            protocol=protocol, model=model, request=converted, parsing=parsing,
            tokenizer=runtime.tokenizer, table=runtime.table, prompt_tokens=len(prompt_ids),
            stop_token_ids=frozenset([runtime.eos_id]), echo=echo, namespace_tools=namespace_tools)
        return PreparedRequest(
            protocol=protocol, model=model, prompt_ids=prompt_ids, sampling=sampling,
            stream=converted.stream, context_length=context,
            stop_sequences=parsing.stop_sequences,
            grammar=grammar,
            response=spec, image_sources=image_sources, traffic_class=traffic, traffic_named=named)

    def with_images(self, prepared: PreparedRequest, images) -> PreparedRequest:
        """Write each resolved image's span over its placeholder (one image token each, in order) and
        check the longer prompt against the context again. `images`: messages.images.ImageInput."""
        runtime = self._models[prepared.model]
        image_token = runtime.image_token_id
        spots = [i for i, token in enumerate(prepared.prompt_ids) if token == image_token]
        if len(spots) != len(images):
            raise invalid_request(f"the prompt has {len(spots)} image placeholders for {len(images)} images: "
                                  f"text may not contain the image token {V41_IMAGE_TOKEN!r}",
                                  param=_PROMPT_PARAM[prepared.protocol], code="invalid_image_placeholder")
        prompt, placed, last = [], [], 0
        for spot, image in zip(spots, images):
            prompt.extend(prepared.prompt_ids[last:spot])
            placed.append(msgspec.structs.replace(image, start=len(prompt)))
            prompt.extend([image_token] * image.grid.tokens)
            last = spot + 1
        prompt.extend(prepared.prompt_ids[last:])
        converted = prepared.response.request
        max_tokens = self._max_tokens(prepared.protocol, converted, len(prompt), prepared.context_length)
        sampling = msgspec.structs.replace(prepared.sampling, max_tokens=min(prepared.sampling.max_tokens, max_tokens))
        spec = replace(prepared.response, prompt_tokens=len(prompt))
        return replace(prepared, prompt_ids=prompt, sampling=sampling, response=spec, image_sources=(),
                       images=tuple(placed))

    @staticmethod
    def _max_tokens(protocol: Protocol, converted: ConversationRequest, prompt: int,
                    context: int) -> int:
        """Resolve max_tokens so that prompt + max_tokens <= context."""
        requested = converted.inference_options.max_tokens
        if prompt >= context or (requested is not None and prompt + requested > context):
            raise context_exceeded(protocol, prompt, requested, context)
        try:
            resolved = converted.resolve_max_tokens(prompt, context)
        except ConversionError:
            raise context_exceeded(protocol, prompt, requested, context) from None
        return max(1, min(resolved, context - prompt))


def context_exceeded(protocol: Protocol, prompt: int, requested: int | None,
                     context: int) -> GatewayError:
    if protocol is Protocol.MESSAGES:
        if prompt >= context:
            message = f"prompt is too long: {prompt} tokens > {context - 1} maximum"
        else:
            message = (f"max_tokens: {requested} + prompt {prompt} tokens > {context}, the "
                       f"model's context window; lower max_tokens to at most {context - prompt}")
        return invalid_request(message, param="max_tokens" if prompt < context else "messages")
    asked = f" ({prompt} in the messages, {requested} in the completion)" if requested else ""
    return invalid_request(
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + (requested or 0)} tokens{asked}. Please reduce the length of the input or "
        f"the completion.", param=_PROMPT_PARAM[protocol] if prompt >= context else "max_tokens",
        code="context_length_exceeded")


def _grammar_ref(runtime: ModelRuntime, constraint: dict | None, parsing) -> GrammarRef | None:
    if constraint is None:
        return None
    spelled = constraint_json(constraint)
    thinking = parsing.thinking_stage is not None and parsing.thinking_stage.starts_in_reasoning()
    # In thinking mode the constraint starts once the reasoning ends: after the model's `</think>`.
    after = runtime.table.added_ids.get(parsing.think_end, -1) if thinking else -1
    return GrammarRef(key=constraint_key(runtime.tokenizer_id, spelled), constraint=spelled,
                      tokenizer_id=runtime.tokenizer_id, after_token=after)


def _or(value, default):
    return default if value is None else value


SIZED_DETAILS = ("high", "auto")   # V4.1 sizes every image by one rule: what "high" (the default) asks


def refuse_image_detail(conversation, sources) -> None:
    """`detail: "low"` asks for a cheaper, coarser image; V4.1's rule has no such mode, so it is
    refused rather than billed and encoded at full size."""
    details = [source.detail for message in conversation.messages for source in message.image_sources]
    for detail, (_, _, path) in zip(details, sources):
        if detail not in SIZED_DETAILS:
            raise invalid_request(f"image detail {detail!r} is not supported: every image is sized by the "
                                  f"model's own rule, as 'high'; omit detail or send 'auto' or 'high' ({path})",
                                  param=path or None, code="unsupported_parameter")
