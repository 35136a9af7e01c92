"""``verify=True``: every file that decides the model's output matches ``SHA256SUMS``.

``SHA256SUMS`` is in ``sha256sum`` format (``<64 hex>  <name>``, names relative to the checkpoint
directory, ``/`` separated). Checked files: ``config.json``, ``inference/config.json``, the index,
every shard, the Engram token map and the tokenizer files (:data:`OUTPUT_FILES`, plus names a
caller adds): each present one must be listed, every listed one must exist and match. A listed
name or a shard name that leads outside the directory (absolute, ``..``, a symlink out) is rejected.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from flashrt.errors import CheckpointError

from .shards import INDEX, SINGLE, inside, shard_files

SUMS = "SHA256SUMS"
# files besides the shards whose content changes what the model computes or emits
OUTPUT_FILES = ("config.json", "inference/config.json", INDEX, "engram_token_map.json", "engram_token_map.npy",
                "tokenizer.json", "tokenizer_config.json")
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_sums(path: Path) -> dict[str, str]:
    """Listed name -> lowercase digest; ``CheckpointError`` for a malformed line or a name outside."""
    sums = path / SUMS
    if not sums.is_file():
        raise CheckpointError(f"{sums}: missing, cannot verify the checkpoint")
    listed = {}
    for line in sums.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise CheckpointError(f"{sums}: malformed line {line!r}")
        digest, name = match.groups()
        inside(path, name, f"{sums} entry", follow_links=True)
        listed[name] = digest.lower()
    return listed


def add_to_sums(path, names) -> None:
    """List (or re-list) ``names`` in ``path``'s ``SHA256SUMS`` with their current digests, for files
    added to a saved checkpoint (e.g. its tokenizer); the file is replaced atomically."""
    from flashrt.jit import atomic_write

    path = Path(path)
    listed = read_sums(path)
    for name in names:
        file = inside(path, name, "checkpoint file", follow_links=True)
        if not file.is_file():
            raise CheckpointError(f"{file}: no such file to list in {SUMS}")
        listed[name] = sha256_file(file)
    atomic_write(path / SUMS, "".join(f"{d}  {n}\n" for n, d in sorted(listed.items())).encode())


def required_files(path: Path, extra=()) -> list[str]:
    """The names :func:`verify_checksums` requires in ``SHA256SUMS``: the shards, and each of
    :data:`OUTPUT_FILES` and ``extra`` present in ``path``."""
    names = [n for n in (*OUTPUT_FILES, *extra) if (path / n).exists()]
    if (path / INDEX).is_file() or (path / SINGLE).is_file():
        names += shard_files(path)[0]
    names += [p.name for p in sorted(path.glob("*.safetensors"))]
    return list(dict.fromkeys(names))


def verify_checksums(path, extra=()) -> None:
    """CheckpointError naming the file unless every required file is listed and every listed file
    matches ``SHA256SUMS`` (``extra``: more names whose content changes the output)."""
    path = Path(path)
    listed = read_sums(path)
    for name in required_files(path, extra):
        inside(path, name, "checkpoint file", follow_links=True)
        if name not in listed:
            raise CheckpointError(f"{path / name}: not listed in {SUMS}")
    for name, digest in listed.items():
        file = path / name
        found = sha256_file(file) if file.is_file() else "no such file"
        if found != digest:
            raise CheckpointError(f"{file}: sha256 mismatch, expected {digest}, found {found}")
