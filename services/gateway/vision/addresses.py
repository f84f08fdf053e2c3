"""Which addresses an image fetch may connect to, and a resolver that returns only those.

The check and the connection use the same answer: `CheckedResolver` sits inside aiohttp's
connector, so the addresses it returns are the ones connected to. A name that resolves to a public
address for a check and to 127.0.0.1 for the connection (DNS rebinding) has no second lookup to
exploit. aiohttp skips resolvers for literal IP hosts; the fetcher checks those itself with
`AddressPolicy.check_host`.
"""
from __future__ import annotations

import ipaddress

from aiohttp.abc import AbstractResolver, ResolveResult

from services.gateway.adapter.images import is_public_address
from services.gateway.vision.errors import FORBIDDEN, ImageFetchError


class AddressPolicy:
    """Globally routable unicast addresses, plus the operator's `allow_networks`."""

    def __init__(self, networks=()) -> None:
        self._networks = list(networks)

    def allows(self, address: str) -> bool:
        if is_public_address(address):
            return True
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self._networks)

    def check_host(self, host: str) -> None:
        """Refuse a literal IP host that is not allowed; names are left to the resolver."""
        literal = host.strip("[]")
        try:
            ipaddress.ip_address(literal.split("%", 1)[0])
        except ValueError:
            return
        if not self.allows(literal):
            raise ImageFetchError(FORBIDDEN, f"image URLs may not point to {literal}")


class CheckedResolver(AbstractResolver):
    """Resolves with `inner` (the system resolver) and keeps only the addresses the policy allows."""

    def __init__(self, policy: AddressPolicy, inner: AbstractResolver) -> None:
        self._policy = policy
        self._inner = inner

    async def resolve(self, host: str, port: int = 0, family=0) -> list[ResolveResult]:
        answers = await self._inner.resolve(host, port, family=family)
        allowed = [answer for answer in answers if self._policy.allows(answer["host"])]
        if not allowed:
            found = ", ".join(sorted({answer["host"] for answer in answers})) or "nothing"
            raise ImageFetchError(FORBIDDEN, f"image URL host {host} resolves to {found}; "
                                             f"only public addresses may be fetched")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
