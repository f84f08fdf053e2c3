"""The on-disk formats of the KV store, pure functions over bytes (no file handling here).

Layout under the store's root directory (the same on a local disk and on a 3FS mount):

  segments/<seq as 12 digits>.kvs   segment files, ~segment_bytes each, append-only, then sealed
  index-<gen as 8 digits>.log       the index log the writer publishes for readers in other processes
  writer.lock                       held (flock) by the one writer process

Segment file = segment header (64 bytes) | record | record | ... | [footer entries | trailer].

Record = header (a multiple of 16 bytes) | payload:
  magic "EKV1" | header_len u16 | version u8 | checksum kind u8 | traffic class u8 | key_len u8 |
  dtype code u8 | ndim u8 | layout_len u8 | 3 pad | expires_at f64 | written_at f64 |
  payload_len u64 | payload checksum u32 | key | layout | shape (ndim x i64) | zero pad |
  header checksum u32 (over every header byte before it)
The header checksum lets a scan trust a header without reading its payload; the payload checksum is
verified on every read. The checksum is crc32c (the `crc32c` package, a dependency: hardware CRC is
~3x cheaper than zlib's crc32 and keeps writes near plain-file speed); zlib's crc32 where that
package is missing. The record names which, so either reader verifies either record.

A sealed segment ends with its footer: one `Entry` per record (the same 72-byte struct the index log
uses), then a 32-byte trailer (magic "EKVSEAL1" | footer offset | entry count | footer checksum |
trailer checksum). Restart reads a sealed segment's footer only; an unsealed one (the writer died)
is scanned record by record with every payload verified, cut after the last good record, sealed.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

try:   # hardware crc32c; a missing package falls back to zlib (the record says which it carries)
    import crc32c as _crc32c_mod
    _crc32c = _crc32c_mod.crc32c
except ImportError:   # pragma: no cover - depends on the environment
    _crc32c = None

CRC32, CRC32C = 1, 2
DEFAULT_CHECKSUM = CRC32C if _crc32c is not None else CRC32
MAX_KEY_BYTES = 32
MAX_LAYOUT_BYTES = 255
MAX_NDIM = 8

# Append-only: a code names a dtype forever (the names of messages.tensors).
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "bool", "float8_e4m3fn")
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPES)}

RECORD_MAGIC = b"EKV1"
RECORD_VERSION = 1
_FIXED = struct.Struct("<4sHBBBBBBB3xddQI")          # 44 bytes, then key, layout, shape, pad, crc
_HEADER_ALIGN = 16
_MAX_HEADER = -(-(_FIXED.size + MAX_KEY_BYTES + MAX_LAYOUT_BYTES + 8 * MAX_NDIM + 4) // 16) * 16
MIN_RECORD_BYTES = 48                                  # the smallest header, no payload
MAX_RECORD_BYTES = 1 << 36

SEGMENT_MAGIC = b"EKVSEG01"
SEGMENT_HEADER = struct.Struct("<8sHxxxxxxQdd16xI4x")   # 64 bytes: magic, version, seq, slice end, created
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size

TRAILER_MAGIC = b"EKVSEAL1"
TRAILER = struct.Struct("<8sQQII")                      # magic, footer offset, count, footer crc, crc
TRAILER_SIZE = TRAILER.size

LOG_MAGIC = b"EKVIDX01"
LOG_HEADER = struct.Struct("<8sQd4xI")                  # 32 bytes: magic, generation, created, crc
LOG_HEADER_SIZE = LOG_HEADER.size

# One index fact: PUT (a record is published), DROP_SEGMENT (a whole segment is gone), DROP_KEY
# (one record found corrupt). Also the footer entries of a sealed segment (always PUT).
PUT, DROP_SEGMENT, DROP_KEY = 1, 2, 3
ENTRY = struct.Struct("<BBHIQQQd32s")                  # 72 bytes; crc over the rest of the entry
ENTRY_SIZE = ENTRY.size
assert _FIXED.size == 44 and SEGMENT_HEADER_SIZE == 64 and TRAILER_SIZE == 32
assert LOG_HEADER_SIZE == 32 and ENTRY_SIZE == 72


class FormatError(ValueError):
    """Bytes that are not a valid structure (torn, corrupt, or not ours)."""


def checksum(data, kind: int = DEFAULT_CHECKSUM, start: int = 0) -> int:
    if kind == CRC32:
        return zlib.crc32(data, start)
    if kind == CRC32C and _crc32c is not None:
        return _crc32c(data, start)
    raise FormatError(f"checksum kind {kind} is not available in this process")


def dtype_code(name: str) -> int:
    try:
        return _DTYPE_CODE[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} cannot be stored") from None


# ---- records --------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class RecordHeader:
    key: bytes
    traffic_class: int
    expires_at: float
    written_at: float
    dtype: str
    shape: tuple[int, ...]
    layout: str
    header_len: int
    payload_len: int
    payload_crc: int
    checksum_kind: int

    @property
    def length(self) -> int:
        return self.header_len + self.payload_len


def encode_record_header(key: bytes, traffic_class: int, expires_at: float, written_at: float, dtype: str,
                         shape: tuple[int, ...], layout: str, payload, kind: int = DEFAULT_CHECKSUM,
                         payload_crc: int | None = None) -> bytes:
    """The header of a record whose payload is `payload` (any bytes-like object), checksummed here
    unless its checksum (of `kind`) is given."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes (1..{MAX_KEY_BYTES})")
    layout_b = layout.encode()
    if len(layout_b) > MAX_LAYOUT_BYTES or len(shape) > MAX_NDIM:
        raise ValueError("layout or shape too long")
    payload_len = memoryview(payload).nbytes
    body = len(key) + len(layout_b) + 8 * len(shape)
    header_len = -(-(_FIXED.size + body + 4) // _HEADER_ALIGN) * _HEADER_ALIGN
    fixed = _FIXED.pack(RECORD_MAGIC, header_len, RECORD_VERSION, kind, traffic_class, len(key), dtype_code(dtype),
                        len(shape), len(layout_b), expires_at, written_at, payload_len,
                        checksum(payload, kind) if payload_crc is None else payload_crc)
    head = b"".join((fixed, key, layout_b, struct.pack(f"<{len(shape)}q", *shape)))
    head += bytes(header_len - 4 - len(head))
    return head + struct.pack("<I", checksum(head, kind))


def decode_record_header(buf) -> RecordHeader:
    """Parse and verify a record header at the start of `buf` (at least the whole header)."""
    view = memoryview(buf)
    if view.nbytes < _FIXED.size:
        raise FormatError("short record header")
    (magic, header_len, version, kind, traffic, key_len, dtype, ndim, layout_len, expires_at, written_at,
     payload_len, payload_crc) = _FIXED.unpack_from(view)
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        raise FormatError("not a record (magic or version)")
    if header_len % _HEADER_ALIGN or not _FIXED.size + 4 <= header_len <= _MAX_HEADER or header_len > view.nbytes:
        raise FormatError(f"bad header length {header_len}")
    (stored,) = struct.unpack_from("<I", view, header_len - 4)
    if checksum(view[:header_len - 4], kind) != stored:
        raise FormatError("record header checksum mismatch")
    body = _FIXED.size
    if body + key_len + layout_len + 8 * ndim + 4 > header_len or dtype >= len(DTYPES) or not key_len:
        raise FormatError("inconsistent record header")
    key = bytes(view[body:body + key_len])
    body += key_len
    layout = bytes(view[body:body + layout_len]).decode(errors="replace")
    body += layout_len
    shape = struct.unpack_from(f"<{ndim}q", view, body)
    return RecordHeader(key, traffic, expires_at, written_at, DTYPES[dtype], tuple(shape), layout, header_len,
                        payload_len, payload_crc, kind)


def max_header_len() -> int:
    return _MAX_HEADER


# ---- segment header and trailer -------------------------------------------------------------
def encode_segment_header(seq: int, slice_end: float, created_at: float) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, 1, seq, slice_end, created_at, 0)
    return head[:-8] + struct.pack("<I", zlib.crc32(head[:-8])) + bytes(4)


def decode_segment_header(buf) -> tuple[int, float, float]:
    """(seq, slice end, created at) of a segment header."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        raise FormatError("short segment header")
    magic, version, seq, slice_end, created_at, crc = SEGMENT_HEADER.unpack_from(buf)
    if magic != SEGMENT_MAGIC or version != 1 or zlib.crc32(bytes(buf[:SEGMENT_HEADER_SIZE - 8])) != crc:
        raise FormatError("not a segment header (magic, version or checksum)")
    return seq, slice_end, created_at


def encode_trailer(footer_offset: int, count: int, footer_crc: int) -> bytes:
    head = TRAILER.pack(TRAILER_MAGIC, footer_offset, count, footer_crc, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def decode_trailer(buf) -> tuple[int, int, int]:
    """(footer offset, entry count, footer crc), or FormatError where there is no valid trailer."""
    if len(buf) != TRAILER_SIZE:
        raise FormatError("short trailer")
    magic, offset, count, footer_crc, crc = TRAILER.unpack(buf)
    if magic != TRAILER_MAGIC or zlib.crc32(bytes(buf[:-4])) != crc:
        raise FormatError("no seal trailer")
    return offset, count, footer_crc


# ---- index entries (index log and segment footers) ------------------------------------------
@dataclass(slots=True, frozen=True)
class Entry:
    kind: int
    seq: int
    offset: int = 0
    length: int = 0
    expires_at: float = 0.0
    key: bytes = b""


def encode_entry(e: Entry) -> bytes:
    if len(e.key) > MAX_KEY_BYTES:
        raise ValueError("key too long")
    raw = ENTRY.pack(e.kind, len(e.key), 0, 0, e.seq, e.offset, e.length, e.expires_at, e.key)
    crc = zlib.crc32(raw[8:], zlib.crc32(raw[:4]))
    return raw[:4] + struct.pack("<I", crc) + raw[8:]


def decode_entry(buf, at: int = 0) -> Entry:
    kind, key_len, _, crc, seq, offset, length, expires_at, key = ENTRY.unpack_from(buf, at)
    view = memoryview(buf)[at:at + ENTRY_SIZE]
    if zlib.crc32(view[8:], zlib.crc32(view[:4])) != crc or kind not in (PUT, DROP_SEGMENT, DROP_KEY) \
            or key_len > MAX_KEY_BYTES:
        raise FormatError("bad index entry")
    return Entry(kind, seq, offset, length, expires_at, key[:key_len])


# Many entries at once, as numpy records with the same 72-byte layout (footers hold up to millions).
ENTRY_DTYPE = np.dtype([("kind", "u1"), ("key_len", "u1"), ("reserved", "<u2"), ("crc", "<u4"), ("seq", "<u8"),
                        ("offset", "<u8"), ("length", "<u8"), ("expires", "<f8"), ("key", "V32")])
assert ENTRY_DTYPE.itemsize == ENTRY_SIZE


def entry_array(entries: list[Entry]) -> np.ndarray:
    arr = np.zeros(len(entries), ENTRY_DTYPE)
    if entries:
        arr["kind"] = [e.kind for e in entries]
        arr["key_len"] = [len(e.key) for e in entries]
        arr["seq"] = [e.seq for e in entries]
        arr["offset"] = [e.offset for e in entries]
        arr["length"] = [e.length for e in entries]
        arr["expires"] = [e.expires_at for e in entries]
        arr["key"] = np.frombuffer(b"".join(e.key.ljust(MAX_KEY_BYTES, b"\0") for e in entries), "V32")
    return arr


def entry_key(row) -> bytes:
    """The key of one ENTRY_DTYPE record."""
    return bytes(row["key"])[:int(row["key_len"])]


def encode_entries(arr: np.ndarray) -> bytes:
    """The bytes of many entries, each with its checksum."""
    arr = np.ascontiguousarray(arr, ENTRY_DTYPE)
    arr["crc"] = 0
    view = memoryview(arr.view(np.uint8))
    crc32 = zlib.crc32
    arr["crc"] = [crc32(view[at + 8:at + ENTRY_SIZE], crc32(view[at:at + 4]))
                  for at in range(0, len(arr) * ENTRY_SIZE, ENTRY_SIZE)]
    return arr.tobytes()


def decode_entries(buf, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Whole entries in `buf` as records, and which are valid (checksum, kind, key length); without
    `verify` (a footer, checksummed as a whole) only kind and key length are checked."""
    n = len(buf) // ENTRY_SIZE
    arr = np.frombuffer(buf, ENTRY_DTYPE, n).copy()
    ok = np.isin(arr["kind"], (PUT, DROP_SEGMENT, DROP_KEY)) & (arr["key_len"] <= MAX_KEY_BYTES)
    if verify and n:
        view = memoryview(buf)
        crc32 = zlib.crc32
        good = np.fromiter((crc32(view[at + 8:at + ENTRY_SIZE], crc32(view[at:at + 4]))
                            for at in range(0, n * ENTRY_SIZE, ENTRY_SIZE)), np.uint32, n)
        ok &= good == arr["crc"]
    return arr, ok


def encode_log_header(generation: int, created_at: float) -> bytes:
    head = LOG_HEADER.pack(LOG_MAGIC, generation, created_at, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def decode_log_header(buf) -> int:
    """The generation of an index log header."""
    if len(buf) < LOG_HEADER_SIZE:
        raise FormatError("short index log header")
    magic, generation, _, crc = LOG_HEADER.unpack_from(buf)
    if magic != LOG_MAGIC or zlib.crc32(bytes(buf[:LOG_HEADER_SIZE - 4])) != crc:
        raise FormatError("not an index log")
    return generation


def segment_name(seq: int) -> str:
    return f"{seq:012d}.kvs"


def parse_segment_name(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    return int(stem) if ext == "kvs" and dot and len(stem) == 12 and stem.isdigit() else None


def log_name(generation: int) -> str:
    return f"index-{generation:08d}.log"


def parse_log_name(name: str) -> int | None:
    if name.startswith("index-") and name.endswith(".log"):
        stem = name[6:-4]
        if len(stem) == 8 and stem.isdigit():
            return int(stem)
    return None


def format_location(seq: int, offset: int, length: int) -> str:
    return f"{seq}:{offset}:{length}"


def parse_location(text: str) -> tuple[int, int, int]:
    try:
        seq, offset, length = (int(part) for part in text.split(":"))
    except ValueError:
        raise FormatError(f"bad location {text!r} (segment:offset:length)") from None
    if seq < 0 or offset < SEGMENT_HEADER_SIZE or length <= 0:
        raise FormatError(f"bad location {text!r}")
    return seq, offset, length
