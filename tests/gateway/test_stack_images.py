"""Images through the official SDKs on the default stack (real processes: the vision balancer and
worker included). The model has random weights, so these assert what is exact: the prompt grows
with the image, the same image twice is a prefix hit, another image is not, and a bad image is a
400 in each protocol's shape."""
from __future__ import annotations

import base64
import subprocess
import sys

import anthropic
import openai
import pytest

from tests.helpers.test_helper_image_gateway import png_for_tests

pytestmark = pytest.mark.slow   # starts service processes

MODEL = "deepseek-v41-tiny"
NO_THINKING = {"thinking": {"type": "disabled"}}
SMALL, LARGE = png_for_tests(40, 30), png_for_tests(600, 450, shade=60)
OTHER_SMALL = png_for_tests(40, 30, shade=200)
HUGE = png_for_tests(9000, 6000)   # 54 MP: over the gateway's 50 MP, in a small file
# Text around the image so it sits inside full 128-token blocks: cached blocks cover it.
BEFORE = "Look closely at the picture that follows and describe it in plain words. " * 10
AFTER = "Now list three colours you can see in it, one per line, and nothing else. " * 10


@pytest.fixture
def oai(stack):
    return openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture
def claude(stack):
    return anthropic.Anthropic(base_url=stack["url"], api_key="unused", max_retries=0, timeout=180)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat(oai, png: bytes | None = None, url: str | None = None):
    image = {"type": "image_url", "image_url": {"url": url or data_url(png)}}
    return oai.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0, extra_body=NO_THINKING,
        messages=[{"role": "user", "content": [{"type": "text", "text": BEFORE}, image,
                                               {"type": "text", "text": AFTER}]}])


def responses(oai, png: bytes):
    return oai.responses.create(model=MODEL, max_output_tokens=3, reasoning={"effort": "none"}, input=[
        {"role": "user", "content": [{"type": "input_text", "text": BEFORE},
                                     {"type": "input_image", "image_url": data_url(png)},
                                     {"type": "input_text", "text": AFTER}]}])


def messages(claude, source: dict):
    return claude.messages.create(model=MODEL, max_tokens=3, extra_body=NO_THINKING, messages=[
        {"role": "user", "content": [{"type": "text", "text": BEFORE}, {"type": "image", "source": source},
                                     {"type": "text", "text": AFTER}]}])


def base64_source(png: bytes) -> dict:
    return {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}


def test_usage_grows_with_the_image_in_every_api(oai, claude):
    small, large = chat(oai, SMALL).usage.prompt_tokens, chat(oai, LARGE).usage.prompt_tokens
    assert large > small
    r_small, r_large = responses(oai, SMALL).usage.input_tokens, responses(oai, LARGE).usage.input_tokens
    assert r_large - r_small == large - small
    m_small = messages(claude, base64_source(SMALL)).usage
    m_large = messages(claude, base64_source(LARGE)).usage
    grown = (m_large.input_tokens + (m_large.cache_read_input_tokens or 0)
             - m_small.input_tokens - (m_small.cache_read_input_tokens or 0))
    assert grown == large - small


def test_the_same_image_is_a_prefix_hit_and_another_is_not(oai, claude):
    first = chat(oai, SMALL)
    again = chat(oai, SMALL)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256, again.usage   # blocks past the image's come from the cache
    other = chat(oai, OTHER_SMALL)
    assert other.usage.prompt_tokens == first.usage.prompt_tokens   # same size, same length
    assert other.usage.prompt_tokens_details.cached_tokens < cached  # nothing from the image's block on
    again_claude = messages(claude, base64_source(SMALL))   # the same image through another API: same prompt
    assert (again_claude.usage.cache_read_input_tokens or 0) >= 256


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x.png", "http://10.0.0.1/x.png",
                                 "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd",
                                 "CORRUPT", "OVERSIZED"])
def test_bad_images_are_400s(oai, claude, url):
    png = {"CORRUPT": SMALL[:-40], "OVERSIZED": HUGE}.get(url)
    with pytest.raises(openai.BadRequestError) as chat_error:
        chat(oai, png, url=None if png is not None else url)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, max_output_tokens=3, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(png) if png is not None else url}]}])
    source = base64_source(png) if png is not None else {"type": "url", "url": url}
    with pytest.raises(anthropic.BadRequestError) as claude_error:
        messages(claude, source)
    assert chat_error.value.status_code == claude_error.value.status_code == 400
    assert claude_error.value.body["type"] == "error"


def test_status_lists_the_vision_pool(stack):
    out = subprocess.run([sys.executable, "-m", "ops.cli", "status"], cwd=stack["root"], env=stack["env"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for kind in ("vision_balancer", "vision_worker"):
        assert any(kind in line and "RUNNING" in line.upper() for line in lines), out.stdout
