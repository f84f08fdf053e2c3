"""The on-disk formats: every structure round-trips, and any flipped bit in a header, an index entry
or a trailer is detected."""
from __future__ import annotations

import pytest

from kvstore import record as fmt
from kvstore.record import Entry, FormatError


def header(**overrides) -> bytes:
    args = dict(key=bytes(range(16)), traffic_class=1, expires_at=1.5e9, written_at=1.4e9, dtype="bfloat16",
                shape=(3, 4), layout="v4/bf16", payload=bytes(24))
    args.update(overrides)
    return fmt.encode_record_header(**args)


def test_record_header_round_trips():
    raw = header()
    assert len(raw) % 16 == 0
    h = fmt.decode_record_header(raw + bytes(24))
    assert (h.key, h.traffic_class, h.expires_at, h.written_at) == (bytes(range(16)), 1, 1.5e9, 1.4e9)
    assert (h.dtype, h.shape, h.layout, h.payload_len, h.header_len) == ("bfloat16", (3, 4), "v4/bf16", 24, len(raw))
    assert h.payload_crc == fmt.checksum(bytes(24), h.checksum_kind)
    assert h.length == len(raw) + 24


def test_every_flipped_header_bit_is_detected():
    raw = header()
    for i in range(len(raw)):
        for bit in (0, 7):
            broken = bytearray(raw)
            broken[i] ^= 1 << bit
            with pytest.raises(FormatError):
                fmt.decode_record_header(bytes(broken))


@pytest.mark.parametrize("bad", [dict(key=b""), dict(key=bytes(33)), dict(dtype="complex64"),
                                 dict(layout="x" * 256), dict(shape=(1,) * 9)])
def test_unencodable_records_are_refused(bad):
    with pytest.raises(ValueError):
        header(**bad)


def test_index_entries_round_trip_and_detect_flips():
    e = Entry(fmt.PUT, 7, 4096, 881_000, 1.9e9, bytes(range(16)))
    raw = fmt.encode_entry(e)
    assert len(raw) == fmt.ENTRY_SIZE and fmt.decode_entry(raw) == e
    assert fmt.decode_entry(b"xx" + raw, 2) == e
    for i in range(len(raw)):
        broken = bytearray(raw)
        broken[i] ^= 0x10
        with pytest.raises(FormatError):
            fmt.decode_entry(bytes(broken))


def test_trailer_segment_header_and_log_header_round_trip_and_detect_flips():
    cases = [(fmt.encode_trailer(1000, 12, 0xDEADBEEF), fmt.decode_trailer, (1000, 12, 0xDEADBEEF)),
             (fmt.encode_segment_header(42, 1.9e9, 1.8e9), fmt.decode_segment_header, (42, 1.9e9, 1.8e9)),
             (fmt.encode_log_header(5, 1.8e9), fmt.decode_log_header, 5)]
    for raw, decode, expected in cases:
        assert decode(raw) == expected
        for i in range(len(raw)):
            broken = bytearray(raw)
            broken[i] ^= 0x01
            if raw is cases[1][0] and i >= 56 + 4:   # the segment header's last 4 bytes are reserved
                continue
            with pytest.raises(FormatError):
                decode(bytes(broken))


def test_names_and_locations_parse_back():
    assert fmt.parse_segment_name(fmt.segment_name(12)) == 12
    assert fmt.parse_segment_name("next-seq") is None and fmt.parse_segment_name("12.kvs") is None
    assert fmt.parse_log_name(fmt.log_name(3)) == 3 and fmt.parse_log_name("index-3.log.tmp") is None
    assert fmt.parse_location(fmt.format_location(3, 64, 100)) == (3, 64, 100)
    for bad in ("3:64", "a:b:c", "3:10:100", "3:64:0", "-1:64:5"):
        with pytest.raises(FormatError):
            fmt.parse_location(bad)


def test_a_checksum_this_process_cannot_compute_is_a_format_error(monkeypatch):
    monkeypatch.setattr(fmt, "_crc32c", None)
    with pytest.raises(FormatError):
        fmt.checksum(b"abc", fmt.CRC32C)
    assert fmt.checksum(b"abc", fmt.CRC32) == fmt.checksum(b"abc", fmt.CRC32)
