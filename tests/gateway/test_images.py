"""Finding image parts in a request body (refused until vision workers exist), and the SSRF
destination filter used by every image fetcher the gateway builds."""
from __future__ import annotations

import pytest

from services.gateway.adapter import destination_filter, is_public_address
from services.gateway.adapter.images import first_image

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


def test_first_image_finds_the_part_of_each_api_and_names_where_it_is():
    chat = [{"role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "x"},
                                         {"type": "image_url", "image_url": {"url": "https://a/b.png"}}]}]
    responses = [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "https://a/b.png"}]}]
    messages = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "x"}, {"type": "image", "source": {"type": "url", "url": "https://a/b.png"}}]}]}]
    assert first_image(chat, "messages") == "messages[1].content[1]"
    assert first_image(responses, "input") == "input[0].output[0]"
    assert first_image(messages, "messages") == "messages[0].content[0].content[1]"


def test_first_image_ignores_text_tool_arguments_and_odd_shapes():
    no_images = [{"role": "user", "content": "an image_url"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "draw",
                                                    "input": {"type": "image"}}]},
                 "not a message", 5, None]
    assert first_image(no_images, "messages") is None
    assert first_image("just text", "input") is None and first_image(None, "messages") is None


def test_first_image_survives_deeply_nested_tool_results():
    deep: dict = {"type": "image", "source": {}}
    for _ in range(20_000):
        deep = {"type": "tool_result", "content": [deep]}
    assert first_image([{"role": "user", "content": [deep]}], "messages").endswith(".content[0]")
