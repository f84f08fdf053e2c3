"""The SSRF destination filter used by every image fetcher the gateway builds."""
from __future__ import annotations

import pytest

from services.gateway.adapter import destination_filter, is_public_address

REFUSED = ["127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
           "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1",
           "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::a9fe:a9fe", "2002:7f00:1::1",
           "fe80::1%eth0", "not-an-ip", ""]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", REFUSED)
def test_private_loopback_link_local_and_reserved_addresses_are_refused(address):
    assert not is_public_address(address)
    assert destination_filter("example.com", address) is False


@pytest.mark.parametrize("address", ALLOWED)
def test_public_unicast_addresses_are_allowed(address):
    assert is_public_address(address)
