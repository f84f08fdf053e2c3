"""A request's traffic class (adapter/traffic.py): named by the `x-epd-traffic-class` header or the body's
`metadata.traffic_class`, else agent when it carries tools and chatbot when not; anything else is a 400."""
from __future__ import annotations

import pytest

from messages.common import TrafficClass
from services.gateway.adapter import GatewayError, Protocol
from services.gateway.adapter.traffic import HEADER, header_class, resolved_class
from tests.gateway.conftest import BODY, weather_tools


@pytest.mark.parametrize("protocol", list(Protocol))
def test_tools_make_a_request_agent_traffic_and_none_chatbot(adapter, protocol):
    assert adapter.prepare(protocol, BODY[protocol]()).traffic_class == TrafficClass.CHATBOT
    assert adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol))).traffic_class == TrafficClass.AGENT


@pytest.mark.parametrize("protocol", list(Protocol))
def test_metadata_names_the_class_over_the_tools(adapter, protocol):
    prepared = adapter.prepare(protocol, BODY[protocol](tools=weather_tools(protocol),
                                                        metadata={"traffic_class": "chatbot"}))
    assert (prepared.traffic_class, prepared.traffic_named) == (TrafficClass.CHATBOT, True)


def test_an_unknown_metadata_class_is_a_400_naming_it(adapter):
    with pytest.raises(GatewayError) as caught:
        adapter.prepare(Protocol.CHAT, BODY[Protocol.CHAT](metadata={"traffic_class": "batch"}))
    assert caught.value.status == 400 and caught.value.param == "metadata.traffic_class"


def test_the_header_wins_over_an_inferred_class_and_is_refused_against_a_named_one():
    assert header_class("Agent") == TrafficClass.AGENT and header_class(None) is None
    assert resolved_class(TrafficClass.CHATBOT, TrafficClass.AGENT, body_named=False) == TrafficClass.CHATBOT
    assert resolved_class(None, TrafficClass.AGENT, body_named=False) == TrafficClass.AGENT
    with pytest.raises(GatewayError) as caught:
        resolved_class(TrafficClass.CHATBOT, TrafficClass.AGENT, body_named=True)
    assert caught.value.status == 400


@pytest.mark.parametrize("value", ["batch", "", "agent,chatbot"])
def test_an_unknown_header_value_is_a_400_naming_the_header(value):
    with pytest.raises(GatewayError) as caught:
        header_class(value)
    assert caught.value.status == 400 and caught.value.param == HEADER
