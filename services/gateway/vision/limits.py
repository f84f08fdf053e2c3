"""Limits on the images of one request: fetching, decoding and counting."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = 20 << 20                 # one image, fetched or inline
    max_data_url_chars: int = 28 << 20        # the data URL's text (base64 of max_bytes is 4/3 of it)
    total_timeout_s: float = 10.0             # one fetch, all redirects included
    connect_timeout_s: float = 3.0
    max_redirects: int = 3
    allow_networks: tuple[str, ...] = ()      # operator CIDRs fetched although not public (internal stores)
    max_concurrent_fetches: int = 16          # per fetcher, across requests
    max_pixels: int = 50_000_000              # checked from the header, before decoding
    max_images: int = 16                      # per request
    max_total_bytes: int = 64 << 20           # per request, all images together

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_networks", tuple(self.allow_networks))
        for name in ("max_bytes", "max_data_url_chars", "max_concurrent_fetches", "max_pixels",
                     "max_images", "max_total_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ImageLimits.{name} must be positive")
        if self.total_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("ImageLimits timeouts must be positive")
        if self.max_redirects < 0:
            raise ValueError("ImageLimits.max_redirects must be >= 0")
        self.networks()   # a bad CIDR fails here, at start

    def networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        try:
            return [ipaddress.ip_network(cidr, strict=False) for cidr in self.allow_networks]
        except ValueError as exc:
            raise ValueError(f"ImageLimits.allow_networks: {exc}") from None
