"""Records: small structured data and tensors as one 1-D uint8 tensor, without pickle.

What engine saves next to weights (a module's `_extra_state`, how an FP8 weight was
quantized) must survive files that hold only tensors (safetensors, Hugging Face
`save_pretrained`) and `torch.load(weights_only=True)`, and must be safe to read from an
untrusted file. A record is, byte by byte (integers little-endian):

    offset 0            magic, 8 bytes: says what the record is (e.g. b"ENGXSTAT")
    offset 8            format version, uint32
    offset 12           header length H, uint32 (at most MAX_HEADER_BYTES)
    offset 16           header: H bytes of UTF-8 JSON, an object. Its "tensors" member lists
                        the tensors that follow, in order, as [name, dtype, shape]
                        (dtype one of RECORD_DTYPES' names, shape a list of sizes >= 0)
    offset 16 + H       the tensors' elements, each C-contiguous and little-endian, one
                        after the other with no padding; nothing after the last

Reading checks everything against the bytes actually present before it copies anything:
a header that claims more (or less) tensor data than follows, bad JSON (NaN and Infinity
included), duplicate names or keys, an unknown dtype or a bad shape is a ValueError that
names the record.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from typing import Any

import torch

#: dtypes a record's tensors may have, by the name its header gives
RECORD_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
}
_DTYPE_NAMES = {d: name for name, d in RECORD_DTYPES.items()}
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 8
PREFIX = struct.Struct("<8sII")  # magic, version, header length


def encode_record(magic: bytes, version: int, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """`header` (JSON data) and `tensors` as one 1-D uint8 CPU tensor laid out as this module's docstring says."""
    if len(magic) != 8:
        raise ValueError(f"magic: expected 8 bytes, got {magic!r}")
    entries, chunks = [], []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPE_NAMES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: expected a tensor of one of {sorted(RECORD_DTYPES)}, got {got}")
        entries.append([name, _DTYPE_NAMES[t.dtype], list(t.shape)])
        chunks.append(_little_endian_bytes(t))
    try:
        text = json.dumps({**header, "tensors": entries}, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as err:
        raise ValueError(f"header: not representable as JSON ({err})") from None
    raw = b"".join([PREFIX.pack(magic, version, len(text)), text, *chunks])
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def is_record(value: Any, magic: bytes) -> bool:
    """`value` is a dense 1-D uint8 tensor with data that starts with `magic` (cheap: reads 8 bytes)."""
    return (type(value) is torch.Tensor and value.dtype == torch.uint8 and value.dim() == 1 and not value.is_meta
            and value.numel() >= PREFIX.size and value.is_contiguous()
            and bytes(value[:8].tolist()) == magic)


def decode_record(
    value: Any, magic: bytes, versions: tuple[int, ...], where: str
) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
    """(version, header without "tensors", {name: CPU tensor}) of a record; ValueError naming `where` if malformed."""
    raw = _record_bytes(value, where)
    if len(raw) < PREFIX.size:
        raise ValueError(f"{where}: {len(raw)} bytes are too few for a record ({PREFIX.size} at least)")
    got_magic, version, header_len = PREFIX.unpack_from(raw)
    if got_magic != magic:
        raise ValueError(f"{where}: expected a record starting with {magic!r}, got {got_magic!r}")
    if version not in versions:
        readable = " or ".join(map(str, versions))
        raise ValueError(f"{where}: format version {version}; this engine reads version {readable}")
    available = len(raw) - PREFIX.size
    if header_len > min(available, MAX_HEADER_BYTES):
        raise ValueError(f"{where}: the header claims {header_len} bytes, but {available} follow "
                         f"(and at most {MAX_HEADER_BYTES} are allowed); truncated or not a record")
    header = _parse_header(raw[PREFIX.size : PREFIX.size + header_len], where)
    payload = memoryview(raw)[PREFIX.size + header_len :]
    layout, total = [], 0
    for entry in header.pop("tensors"):
        name, dtype, shape = _check_entry(entry, where)
        if any(name == n for n, *_ in layout):
            raise ValueError(f"{where}: tensor {name!r} is listed twice")
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append((name, dtype, shape, total, nbytes))
        total += nbytes
        if total > len(payload):  # before anything is allocated
            raise ValueError(f"{where}: the header describes at least {total} bytes of tensors, but {len(payload)} "
                             "follow (truncated?)")
    if total != len(payload):
        raise ValueError(f"{where}: {len(payload) - total} bytes follow the last tensor the header describes")
    tensors = {name: _from_little_endian(payload[start : start + nbytes], dtype, shape)
               for name, dtype, shape, start, nbytes in layout}
    return version, header, tensors


def _record_bytes(value: Any, where: str) -> bytes:
    if type(value) is not torch.Tensor or value.dtype != torch.uint8 or value.dim() != 1:
        got = f"{type(value).__name__} {value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
            else f"{type(value).__name__} {value!r:.100}"
        raise ValueError(f"{where}: expected a 1-D torch.uint8 tensor, got {got}")
    if value.is_meta:
        raise ValueError(f"{where}: a meta tensor holds no bytes to read (loaded with map_location='meta'?)")
    needed = value.numel()
    if not value.is_contiguous() or value.storage_offset() != 0 or value.untyped_storage().nbytes() != needed:
        raise ValueError(f"{where}: expected a dense tensor (contiguous, offset 0, storage of {needed} bytes), got "
                         f"strides {value.stride()}, offset {value.storage_offset()} and a storage of "
                         f"{value.untyped_storage().nbytes()} bytes")
    return value.cpu().numpy().tobytes()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"duplicate keys in {[k for k, _ in pairs]}")
    return out


def _parse_header(text: bytes, where: str) -> dict[str, Any]:
    try:
        header = json.loads(text.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ValueError(f"{where}: the header is not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise ValueError(f"{where}: expected a header object with a 'tensors' list, got {header!r:.200}")
    return header


def _check_entry(entry: Any, where: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[2], list)):
        raise ValueError(f"{where}: expected each tensor entry as [name, dtype, shape], got {entry!r:.200}")
    name, dtype, shape = entry
    if dtype not in RECORD_DTYPES:
        raise ValueError(f"{where}: tensor {name!r}: dtype: expected one of {sorted(RECORD_DTYPES)}, "
                         f"got {dtype!r:.100}")
    if len(shape) > MAX_DIMS or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{where}: tensor {name!r}: shape: expected at most {MAX_DIMS} ints >= 0, got {shape!r:.200}")
    return name, RECORD_DTYPES[dtype], tuple(shape)


def _little_endian_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if sys.byteorder == "big" and t.element_size() > 1:
        flat = flat.view(torch.uint8).reshape(-1, t.element_size()).flip(-1).reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _from_little_endian(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    if sys.byteorder == "big" and dtype.itemsize > 1:
        raw = raw.reshape(-1, dtype.itemsize).flip(-1).reshape(-1)
    return raw.view(dtype).reshape(shape).clone()  # its own, aligned memory
