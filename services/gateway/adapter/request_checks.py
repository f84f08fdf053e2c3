"""Checks and rewrites on the decoded request body, before deepseek-recipe sees it.

What the library would get wrong or accept silently is handled here:
- `role: "developer"` (OpenAI's newer name for system) is rejected by 0.2.0's Chat Completions
  conversion, and Responses renders it as a user turn; in both it becomes `system`.
- Responses features that need server-side state we do not keep (`previous_response_id`,
  `background`, `conversation`) are refused instead of silently ignored.
- `top_k` (an extension in the OpenAI APIs, standard in Anthropic's) is read here: the library's
  inference options have no top_k; so is `seed` where the library reads none (Responses, Messages).
- `temperature` and `top_p` are read here too: in thinking mode the library resolves both to its
  recommended values whatever the request says, and we honour what the client asked for.
- Anthropic Messages requires `max_tokens` (the real API answers 400 without it); the library would
  default it to the whole context window, and the request would hold a decode slot for that long.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.adapter.errors import GatewayError, Protocol, invalid_request, not_found

_SEED_LIMIT = 1 << 63

_STATELESS_ONLY = {"previous_response_id": "this server does not store responses",
                   "conversation": "this server does not store conversations",
                   "background": "background responses are not supported"}


def requested_model(protocol: Protocol, payload: Any, served: set[str]) -> str:
    if not isinstance(payload, dict):
        raise invalid_request("the request body must be a JSON object")
    model = payload.get("model")
    if model is None:
        raise invalid_request("model: field required", param="model")
    if not isinstance(model, str):
        raise invalid_request("model: expected a string", param="model")
    if model not in served:
        raise model_not_found(protocol, model, served)
    return model


def model_not_found(protocol: Protocol, model: str, served: set[str]) -> GatewayError:
    if protocol.is_openai:
        return not_found(f"The model `{model}` does not exist or you do not have access to it. "
                         f"Served models: {', '.join(sorted(served))}.",
                         param="model", code="model_not_found")
    return not_found(f"model: {model}")


def normalise(protocol: Protocol, payload: dict) -> bool:
    """Rewrite the body in place where needed; return whether anything changed."""
    if protocol is Protocol.RESPONSES:
        for key, why in _STATELESS_ONLY.items():
            if payload.get(key) not in (None, False):
                raise invalid_request(f"{key} is not supported: {why}", param=key,
                                      code="unsupported_parameter")
    if protocol is Protocol.MESSAGES and payload.get("max_tokens") is None:
        raise invalid_request("max_tokens: Field required", param="max_tokens")
    if protocol is Protocol.CHAT:
        return _developer_to_system(payload.get("messages"))
    if protocol is Protocol.RESPONSES:
        return _developer_to_system(payload.get("input"))
    return False


def _developer_to_system(messages: Any) -> bool:
    changed = False
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "developer":
                message["role"] = "system"
                changed = True
    return changed


@dataclass(frozen=True, slots=True)
class RequestedSampling:
    """Sampling values as the client sent them (None: not sent). The library validates
    temperature and top_p during conversion; top_k and seed are validated here."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    top_k: int = 0
    thinking_budget: int = -1   # thinking.budget_tokens (thinking.py); -1 = none


def requested_sampling(payload: dict) -> RequestedSampling:
    return RequestedSampling(temperature=_number(payload.get("temperature")),
                             top_p=_number(payload.get("top_p")), seed=_seed(payload.get("seed")),
                             top_k=top_k(payload))


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _seed(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _SEED_LIMIT:
        raise invalid_request("seed: expected an integer in [0, 2^63)", param="seed")
    return value


def top_k(payload: dict) -> int:
    value = payload.get("top_k")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid_request("top_k: expected a non-negative integer", param="top_k")
    return value
