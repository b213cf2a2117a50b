"""Training text that exists on every machine: the Python standard library's own sources.

A deterministic selection (sorted paths, every file that passes a stable hash test) is
read as bytes; whole files are held out for validation, so validation text is unseen.
`--data PATH` uses any text file or folder instead (a file is split 90/10 by position).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VALIDATION_SHARE = 10  # percent


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 bytes
    val: torch.Tensor
    source: str


def _stable_bucket(path: Path, root: Path) -> int:
    return int(hashlib.sha256(str(path.relative_to(root)).encode()).hexdigest(), 16) % 100


def _read_folder(root: Path, pattern: str, max_bytes: int) -> tuple[bytes, bytes]:
    train, val = bytearray(), bytearray()
    for path in sorted(root.rglob(pattern)):
        if not path.is_file() or "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        target = val if _stable_bucket(path, root) < VALIDATION_SHARE else train
        target += text
        if len(train) >= max_bytes and len(val) >= max_bytes // 9:
            break
    return bytes(train[:max_bytes]), bytes(val[: max(max_bytes // 9, 1)])


def load_corpus(data: str | None = None, *, max_bytes: int = 4_000_000) -> Corpus:
    """Bytes to train and validate on: the stdlib sources, or the file/folder at `data`."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        train, val = _read_folder(root, "*.py", max_bytes)
        source = f"Python {sysconfig.get_python_version()} standard library ({root})"
    else:
        path = Path(data)
        if path.is_dir():
            train, val = _read_folder(path, "*", max_bytes)
        elif path.is_file():
            text = path.read_bytes()[: max_bytes * 10 // 9]
            cut = len(text) * (100 - VALIDATION_SHARE) // 100
            train, val = text[:cut], text[cut:]
        else:
            raise ValueError(f"--data: {data} is neither a file nor a folder")
        source = str(path)
    if len(train) < 1024 or len(val) < 1024:
        raise ValueError(f"--data: {source} has too little text ({len(train)} train / {len(val)} validation bytes; "
                         "need at least 1 KiB of each)")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), source)


def batch_at(data: torch.Tensor, step: int, *, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The [batch, seq_len + 1] windows for `step`: the same for every run with the same seed."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
