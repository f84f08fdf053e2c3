"""Images: where a request has one, and fetching them with an SSRF guard.

`is_public_address` is the address rule of every image fetch: only globally routable unicast
addresses (IPv4-in-IPv6 forms unwrapped). The gateway's fetcher (services/gateway/vision/fetch.py)
applies it to every resolved address and redirect. deepseek-recipe's `ReqwestImageFetcher()`
connects to any address a client's URL names (loopback, the cluster network, cloud metadata at
169.254.169.254...): `safe_image_fetcher` is its filtered form, for code that uses the library's.
For a model without a vision encoder the adapter refuses image inputs (AdapterConfig.accept_images,
unenforced.py); `first_image` finds them in the body, since the V4 encoding would silently turn
each into the text "[Unsupported Image]".
"""
from __future__ import annotations

import ipaddress

from deepseek_recipe import ReqwestImageFetcher

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Content part types that carry an image: OpenAI Chat, OpenAI Responses, Anthropic Messages.
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
# ... and a file or document (the V4 encoding turns each into "[Unsupported Document]").
DOCUMENT_PARTS = frozenset({"file", "input_file", "document"})
_NESTED = ("content", "output")   # a message's parts; tool results carry their own part lists


def part_paths(messages, path: str, part_types: frozenset[str] = IMAGE_PARTS) -> list[str]:
    """Where every part of `part_types` in a message list is (`messages[0].content[1]`), in order.
    Only message content is walked, never tool schemas or tool-call arguments; iteratively, since
    a client may nest tool results deeply."""
    found, todo = [], [(messages, path)]
    while todo:
        value, at = todo.pop()
        if isinstance(value, list):
            todo.extend((item, f"{at}[{i}]") for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            if value.get("type") in part_types:
                found.append(at)
                continue
            todo.extend((value[key], f"{at}.{key}") for key in reversed(_NESTED)
                        if isinstance(value.get(key), list))
    return found


def first_image(messages, path: str, part_types: frozenset[str] = IMAGE_PARTS) -> str | None:
    """Where the first image part (or other `part_types`) in a message list is, or None."""
    found = part_paths(messages, path, part_types)
    return found[0] if found else None


def is_public_address(address: str) -> bool:
    """True only for a globally routable unicast IP (IPv4-in-IPv6 forms are unwrapped)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(str(embedded)):
            return False
    return ip.is_global and not ip.is_multicast


def destination_filter(host: str, address: str) -> bool:
    """The `with_destination_filter` callback: (URL host, one resolved address) -> allowed."""
    return is_public_address(address)


def safe_image_fetcher(max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> ReqwestImageFetcher:
    return ReqwestImageFetcher.with_max_bytes(max_bytes).with_destination_filter(destination_filter)
