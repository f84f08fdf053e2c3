"""Image fetching with an SSRF guard.

deepseek-recipe's `ReqwestImageFetcher()` connects to any address a client's image URL names
(loopback, the cluster network, cloud metadata at 169.254.169.254...). Every fetcher the gateway
builds goes through `safe_image_fetcher`, whose destination filter admits only globally routable
unicast addresses; it is applied by the library to every resolved address and every redirect.
Until vision workers exist the adapter refuses image inputs outright (AdapterConfig.accept_images).
"""
from __future__ import annotations

import ipaddress

from deepseek_recipe import ReqwestImageFetcher

DEFAULT_MAX_IMAGE_BYTES = 20 << 20
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


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
