"""sources_of on real deepseek-recipe conversions (as services/gateway/adapter/prepare.py converts)
in all three APIs: what the recipe gives for data URLs, http URLs, Anthropic base64 blocks and
Responses input_image, and the exact part paths errors name."""
from __future__ import annotations

import base64
import hashlib
import json

from deepseek_recipe import (
    ChatCompletionRequest, ConversionOptions, MessagesRequest, ModelVersion, ResponsesRequest,
)

from messages.images import VisionSizing
from services.gateway.vision import ImageFetcher, ImageResolver, image_part_paths, sources_of
from tests.gateway.vision.conftest import image_bytes_for_tests, limits_for_tests

MODEL = "vision-test-model"
OPTIONS = ConversionOptions().with_model_versions_by_name({MODEL: ModelVersion.DeepseekV41Flash})
PNG = image_bytes_for_tests(30, 20)
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"


def _converted(request_class, payload: dict):
    return request_class(json.dumps(payload).encode()).convert(OPTIONS).conversation


def test_chat_image_urls_data_and_http_in_request_order():
    payload = {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": DATA_URL}},
                                     {"type": "image_url", "image_url": {"url": "https://img.example/a.png",
                                                                         "detail": "low"}}]},
        {"role": "assistant", "content": "Two images."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://img.example/b"}}]}]}
    conversation = _converted(ChatCompletionRequest, payload)
    assert sources_of(conversation) == [("url", DATA_URL, "messages[1]"),     # the recipe's coarse path
                                        ("url", "https://img.example/a.png", "messages[1]"),
                                        ("url", "http://img.example/b", "messages[3]")]
    exact = sources_of(conversation, image_part_paths(payload["messages"], "messages"))
    assert [path for _, _, path in exact] == ["messages[1].content[1]", "messages[1].content[2]",
                                              "messages[3].content[0]"]


def test_responses_input_image_in_messages_and_tool_outputs():
    payload = {"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                     {"type": "input_image", "image_url": DATA_URL},
                                     {"type": "input_image", "image_url": "https://img.example/c.jpg"}]},
        {"type": "function_call", "call_id": "c1", "name": "snap", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": "https://img.example/d.png"}]}]}
    conversation = _converted(ResponsesRequest, payload)
    assert sources_of(conversation) == [("url", DATA_URL, "input[0]"),
                                        ("url", "https://img.example/c.jpg", "input[0]"),
                                        ("url", "https://img.example/d.png", "input[2]")]
    assert image_part_paths(payload["input"], "input") == ["input[0].content[1]", "input[0].content[2]",
                                                           "input[2].output[0]"]


def test_anthropic_base64_blocks_become_data_urls_and_url_blocks_urls():
    payload = {"model": MODEL, "max_tokens": 16, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": B64}},
                                     {"type": "image", "source": {"type": "url", "url": "https://img.example/e"}},
                                     {"type": "text", "text": "Describe"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "snap", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": B64}}]}]}]}
    conversation = _converted(MessagesRequest, payload)
    assert sources_of(conversation) == [
        ("url", DATA_URL, "messages[0].content[0]"),
        ("url", "https://img.example/e", "messages[0].content[1]"),
        ("url", f"data:image/jpeg;base64,{B64}", "messages[2].content[0].tool_result")]
    exact = sources_of(conversation, image_part_paths(payload["messages"], "messages"))
    assert [path for _, _, path in exact][2] == "messages[2].content[0].content[0]"


def test_part_paths_that_do_not_match_the_recipe_fall_back_to_its_paths():
    payload = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}]}]}
    conversation = _converted(ChatCompletionRequest, payload)
    assert sources_of(conversation, ["a", "b"]) == [("url", DATA_URL, "messages[0]")]


async def test_the_same_image_from_two_apis_resolves_to_the_same_digest():
    chat = _converted(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}]}]})
    anthropic = _converted(MessagesRequest, {"model": MODEL, "max_tokens": 16, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": B64}}]}]})
    async with ImageFetcher(limits_for_tests()) as fetcher:
        resolver = ImageResolver(fetcher, VisionSizing())
        images = await resolver.resolve(sources_of(chat) + sources_of(anthropic))
    assert [image.digest for image in images] == [hashlib.sha256(PNG).digest()] * 2
    assert [(image.width, image.height) for image in images] == [(30, 20)] * 2
