"""Port bases for stacks (ops/ports.py): drawn free, and only from $EPD_PORT_RANGE when it is set."""
from __future__ import annotations

import socket

import pytest

from ops.ports import free_port_base, port_free, port_range


def test_a_base_is_drawn_inside_the_configured_range(monkeypatch):
    monkeypatch.setenv("EPD_PORT_RANGE", "23000-23400")
    assert port_range() == (23000, 23400)
    for _ in range(20):
        base = free_port_base(10)
        assert 23000 <= base and base + 100 + 10 <= 23400


def test_a_taken_port_is_never_part_of_a_base(monkeypatch):
    monkeypatch.setenv("EPD_PORT_RANGE", "23500-23612")   # room for exactly two bases of 5 (+100)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 23500))
        assert not port_free(23500)
        for _ in range(20):
            base = free_port_base(5)
            assert base != 23500 and 23500 not in range(base, base + 5)


@pytest.mark.parametrize("text", ["20000", "a-b", "30000-20000", "80-2000", "20000-70000"])
def test_a_malformed_range_is_refused_with_its_text(monkeypatch, text):
    monkeypatch.setenv("EPD_PORT_RANGE", text)
    with pytest.raises(ValueError, match="EPD_PORT_RANGE"):
        port_range()


def test_a_range_too_small_for_the_stack_says_so(monkeypatch):
    monkeypatch.setenv("EPD_PORT_RANGE", "23000-23050")
    with pytest.raises(RuntimeError, match="cannot hold 10 ports"):
        free_port_base(10)


def test_without_the_setting_bases_stay_below_the_ephemeral_range(monkeypatch):
    monkeypatch.delenv("EPD_PORT_RANGE", raising=False)
    low, high = port_range()
    assert low >= 10000 and high <= 65536
    base = free_port_base(10)
    assert low <= base and base + 110 <= high
