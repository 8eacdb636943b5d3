"""Slices of partitioned tensors: TensorFlow's shape-and-slice specs and slice keys.

A partitioned variable (a ``ShardedVariable``, a ``compat.v1`` partitioned
variable) is saved as slices of one full tensor. ``SaveV2``/``RestoreV2``
name each slice by a *shape-and-slice spec*, ``"d0 d1 .. start,len:-:.."``
(the full shape, then per dimension ``start,length`` or ``-`` for all of
it), and a bundle stores each slice under a binary key: TensorFlow's
``OrderedCode`` encoding of ``(0, name, rank, start0, length0, ...)``
(``checkpoint::EncodeTensorNameSlice``), a whole dimension being start 0,
length -1. The full tensor's own entry lists the slices
(``TensorSliceProto``) and holds no bytes.

This module encodes and decodes both, as the bundle writer
(``_bundlewrite``) and reader (``_bundle``, ``_bundleread``) need them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WHOLE = -1  # the length of a dimension a slice takes whole


@dataclass(frozen=True)
class Slice:
    """One slice of a tensor of shape ``full_shape``.

    Attributes:
        full_shape: The whole tensor's shape.
        starts: Start of the slice in each dimension.
        lengths: Its length in each dimension (``WHOLE``: all of it).
    """

    full_shape: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The slice's own shape."""
        return tuple(d if n == WHOLE else n
                     for d, n in zip(self.full_shape, self.lengths, strict=True))

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` in each dimension."""
        return tuple((s, s + n) for s, n in zip(self.starts, self.shape, strict=True))

    @property
    def is_full(self) -> bool:
        """Whether the slice is the whole tensor (``BundleWriter``'s ``IsFullSlice``)."""
        return (all(s == 0 and n == WHOLE for s, n in zip(self.starts, self.lengths, strict=True))
                or self.shape == self.full_shape)


def intersect(a, b) -> tuple[tuple[int, int], ...] | None:
    """The bounds (``Slice.bounds``) that both ``a`` and ``b`` cover; None if no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def full_slice(shape) -> Slice:
    """The slice that is all of a tensor of ``shape``."""
    shape = tuple(int(d) for d in shape)
    return Slice(shape, (0,) * len(shape), (WHOLE,) * len(shape))


def parse_spec(spec: str) -> Slice:
    """``checkpoint::ParseShapeAndSlice``: ``"d0 d1 .. start,len:-:.."``.

    Raises:
        ValueError: Not a spec TensorFlow accepts, or a slice outside the shape.
    """
    parts = spec.split(" ")
    if len(parts) < 2:
        raise ValueError(f"bad shape-and-slice spec {spec!r}")
    try:
        full = tuple(int(d) for d in parts[:-1])
    except ValueError:
        raise ValueError(f"bad shape in shape-and-slice spec {spec!r}") from None
    starts, lengths = [], []
    for item in (x for x in parts[-1].split(":") if x):
        if item == "-":
            starts.append(0)
            lengths.append(WHOLE)
            continue
        fields = [x for x in item.split(",") if x]
        try:
            s, n = (int(v) for v in fields)
        except ValueError:
            raise ValueError(f"bad slice {item!r} in {spec!r}") from None
        if s < 0 or not (n > 0 or n == WHOLE):
            raise ValueError(f"bad slice {item!r} in {spec!r}")
        starts.append(s)
        lengths.append(n)
    if len(starts) != len(full) or any(d < 0 for d in full) or any(
        n != WHOLE and s + n > d for s, n, d in zip(starts, lengths, full, strict=True)
    ):
        raise ValueError(f"slice does not fit the shape in {spec!r}")
    return Slice(full, tuple(starts), tuple(lengths))


# --- OrderedCode (tensorflow/core/lib/strings/ordered_code) ---------------------------

_ESCAPES = {b"\x00": b"\x00\xff", b"\xff": b"\xff\x00"}
_SPECIAL = re.compile(rb"[\x00\xff]")
# Header bits of a signed number, by the length of its encoding (1 to 10 bytes).
_SIGNED_HEADER = {1: 0x80, 2: 0xC0, 3: 0xE0, 4: 0xF0, 5: 0xF8, 6: 0xFC, 7: 0xFE, 8: 0xFF,
                  9: 0xFF80, 10: 0xFFC0}


def encode_string(s: bytes) -> bytes:
    """OrderedCode::WriteString: 0x00 -> 00 ff, 0xff -> ff 00, then the 00 01 terminator."""
    return _SPECIAL.sub(lambda m: _ESCAPES[m.group()], s) + b"\x00\x01"


def encode_unsigned(n: int) -> bytes:
    """OrderedCode::WriteNumIncreasing: a length byte, then the big-endian value."""
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return bytes([len(body)]) + body


def encode_signed(n: int) -> bytes:
    """OrderedCode::WriteSignedNumIncreasing.

    ``length`` bytes of two's complement whose first bits are ``length`` ones
    and a zero (inverted for a negative number), so that the bytes sort as
    the numbers do.
    """
    x = ~n if n < 0 else n
    length = x.bit_length() // 7 + 1
    raw = n & ((1 << (8 * length)) - 1)
    header = _SIGNED_HEADER[length] << 8 * (length - (1 if length < 9 else 2))
    return (raw ^ header).to_bytes(length, "big")


def _decode_unsigned(key: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(key) or key[pos] > 8 or pos + 1 + key[pos] > len(key):
        raise ValueError(f"bad OrderedCode number at byte {pos}")
    end = pos + 1 + key[pos]
    return int.from_bytes(key[pos + 1:end], "big"), end


def _decode_string(key: bytes, pos: int) -> tuple[bytes, int]:
    out = bytearray()
    while True:
        m = _SPECIAL.search(key, pos)
        if m is None or m.start() + 1 >= len(key):
            raise ValueError("unterminated OrderedCode string")
        out += key[pos:m.start()]
        pair = key[m.start():m.start() + 2]
        pos = m.start() + 2
        if pair == b"\x00\x01":
            return bytes(out), pos
        if pair == b"\x00\xff":
            out.append(0)
        elif pair == b"\xff\x00":
            out.append(0xFF)
        else:
            raise ValueError(f"bad OrderedCode escape {pair!r}")


def _decode_signed(key: bytes, pos: int) -> tuple[int, int]:
    if pos >= len(key):
        raise ValueError("truncated OrderedCode number")
    flip = 0 if key[pos] & 0x80 else 0xFF  # a negative number's bits are inverted
    head = (key[pos] ^ flip) << 8 | ((key[pos + 1] ^ flip) if pos + 1 < len(key) else 0)
    length = 0
    while length < 16 and head & (0x8000 >> length):
        length += 1
    if not 1 <= length <= 10 or pos + length > len(key):
        raise ValueError(f"bad OrderedCode number at byte {pos}")
    raw = int.from_bytes(bytes(b ^ flip for b in key[pos:pos + length]), "big")
    value = raw & ((1 << (7 * length - 1)) - 1)  # without the length ones and the zero
    return (~value if flip else value), pos + length


def slice_key(name: str, starts, lengths) -> bytes:
    """checkpoint::EncodeTensorNameSlice: the bundle key of one slice of ``name``."""
    out = [encode_unsigned(0), encode_string(name.encode()), encode_unsigned(len(starts))]
    for s, n in zip(starts, lengths, strict=True):
        out.append(encode_signed(s))
        out.append(encode_signed(n))
    return b"".join(out)


def is_slice_key(key: bytes) -> bool:
    """Whether a bundle key is a slice's (they start with the number 0; names never do)."""
    return key[:1] == b"\x00"


def parse_slice_key(key: bytes) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """checkpoint::DecodeTensorNameSlice: ``(name, starts, lengths)`` of a slice key.

    Raises:
        ValueError: Not a slice key as TensorFlow writes them.
    """
    tag, pos = _decode_unsigned(key, 0)
    if tag != 0:
        raise ValueError("not a tensor slice key")
    name, pos = _decode_string(key, pos)
    rank, pos = _decode_unsigned(key, pos)
    starts, lengths = [], []
    for _ in range(rank):
        s, pos = _decode_signed(key, pos)
        n, pos = _decode_signed(key, pos)
        if s < 0 or not (n > 0 or n == WHOLE):
            raise ValueError(f"bad extent {s},{n} in a tensor slice key")
        starts.append(s)
        lengths.append(n)
    if pos != len(key):
        raise ValueError("trailing bytes after a tensor slice key")
    try:
        text = name.decode()
    except UnicodeDecodeError:
        raise ValueError("a tensor slice key whose name is not UTF-8") from None
    return text, tuple(starts), tuple(lengths)
