"""File utilities at the ground floor of the library: atomic writes, safetensors, hashing.

Every artifact the workflow writes goes through :func:`atomic_write`, so a killed job leaves the
old file or none, never half of one (Snakemake would otherwise see a complete-looking output).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "ArtifactError",
    "atomic_path",
    "atomic_write",
    "load_safetensors",
    "safetensors_float_dtype",
    "save_safetensors",
    "sha256_of",
]


class ArtifactError(OSError):
    """An artifact that cannot be read (truncated, corrupt, missing): the message names the file and
    the workflow rule that rebuilds it."""


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write (a file, or a directory the block creates); it
    replaces ``path`` only if the block succeeds, and is removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            shutil.rmtree(path)  # os.replace cannot replace a non-empty directory
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def atomic_write(
    path: str | os.PathLike, data: str | bytes | Callable[[Path], None], *, encoding: str = "utf-8"
) -> Path:
    """Write ``data`` (text, bytes, or a function that writes the file it is given) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        if callable(data):
            data(tmp)
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding=encoding)
    return Path(path)


def save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically."""
    from safetensors.torch import save_file

    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_safetensors(path: str | os.PathLike, *, rule: str | None) -> dict:
    """All tensors of a safetensors file; an unreadable file raises one ``ArtifactError`` that names
    it and the workflow rule that rebuilds it (``rule``; None for a file no rule writes), instead
    of safetensors' own traceback."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # SafetensorError, OSError, a truncated header: all mean "rebuild it"
        raise unreadable(path, rule, exc) from exc


def safetensors_float_dtype(path: str | os.PathLike, *, rule: str | None):
    """The torch dtype of the first floating-point tensor in a safetensors file (float32 when it has
    none), read from its header alone; an unreadable or truncated file raises ``ArtifactError`` as
    ``load_safetensors`` does, before anything heavier touches it."""
    import torch
    from safetensors import safe_open

    floats = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                dtype = floats.get(f.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    except Exception as exc:  # a truncated export fails here first: name it
        raise unreadable(path, rule, exc) from exc
    return torch.float32


def unreadable(path: str | os.PathLike, rule: str | None, exc: BaseException) -> ArtifactError:
    """The error for an artifact that cannot be read: its path, why, and how to rebuild it."""
    how = (f"rebuild it with `snakemake --forcerun {rule} <target>` (or delete it and rerun)" if rule
           else "write it again (hybrid_llama.models.save_hybrid)")
    return ArtifactError(f"{path}: unreadable or truncated ({type(exc).__name__}: {exc}); {how}")


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
