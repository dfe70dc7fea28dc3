"""Reading training text: source specs -> rows and documents, and the deterministic held-out split.

A *source spec* is a dict from config:

- ``{kind: hf, path: HuggingFaceFW/fineweb-edu, name: sample-10BT, split: train, text_column: text}``
  streamed with ``datasets``;
- ``{kind: local, path: <file | dir | glob>, text_column: text}`` for ``.jsonl``/``.json`` (one object per
  line), ``.parquet`` and ``.csv`` files.

Bad data raises :class:`DataError` naming the file and the line or row. The training-data builders
(``hybrid_llama.data``) and the held-out perplexity (``hybrid_llama.eval.quality``) read through here.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = [
    "DataError",
    "LOCAL_SUFFIXES",
    "column_text",
    "doc_hash",
    "iter_documents",
    "iter_rows",
    "source_files",
    "source_label",
    "split_documents",
    "split_of",
]

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(ValueError):
    """Bad or insufficient input data; the message names the file and line/row."""


# ------------------------------------------------------------------------------- document identity


def doc_hash(text: str) -> str:
    """sha256 hex digest of a document's UTF-8 text (the id recorded in manifests)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_of(text: str, *, heldout_fraction: float, seed: int = 0) -> str:
    """Deterministic document split: ``"heldout"`` for a seeded-hash fraction of texts, else ``"train"``.

    Depends only on (seed, text), so any worker can recompute it without coordination.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    h = hashlib.sha256(f"{seed}\0".encode() + text.encode("utf-8")).digest()
    u = int.from_bytes(h[:8], "big") / 2.0**64
    return "heldout" if u < heldout_fraction else "train"


def split_documents(texts: Iterable[str], *, heldout_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, heldout) lists by :func:`split_of`, each in input order."""
    train: list[str] = []
    heldout: list[str] = []
    for t in texts:
        (heldout if split_of(t, heldout_fraction=heldout_fraction, seed=seed) == "heldout" else train).append(t)
    return train, heldout


# ----------------------------------------------------------------------------------------- readers


def _resolve_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(LOCAL_SUFFIXES))
        if not files:
            raise DataError(f"{p}: directory holds no {'/'.join(LOCAL_SUFFIXES)} files")
        return files
    if p.is_file():
        return [p]
    matches = sorted(Path(m) for m in glob.glob(str(path)) if Path(m).is_file())
    if not matches:
        raise DataError(f"{path}: no such file, directory or glob match")
    return matches


def _read_local(path: Path) -> Iterator[tuple[dict, str]]:
    """Yield (row dict, origin) for one local file; origin is 'file:line N' or 'file:row N'."""
    name = path.name
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    if name.endswith((".jsonl", ".json")):
        n = 0
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}: line {lineno}: expected a JSON object, got {type(row).__name__}")
                n += 1
                yield row, f"{path}: line {lineno}"
        if n == 0:
            raise DataError(f"{path}: empty file (no JSON rows)")
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if table.num_rows == 0:
            raise DataError(f"{path}: empty file (0 rows)")
        # Row numbers are 1-based data rows, as a spreadsheet view would show them.
        for i, row in enumerate(table.to_pylist(), 1):
            yield row, f"{path}: row {i}"
    elif name.endswith(".csv"):
        csv.field_size_limit(1 << 30)  # fineweb documents exceed the 128 KiB default
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise DataError(f"{path}: empty file (no header)")
            n = 0
            for i, row in enumerate(reader, 1):
                n += 1
                yield row, f"{path}: row {i} (line {reader.line_num})"
            if n == 0:
                raise DataError(f"{path}: empty file (header only)")
    else:
        raise DataError(f"{path}: unsupported file type (want {', '.join(LOCAL_SUFFIXES)})")


def source_files(source: dict) -> list[Path]:
    """The local files a source spec reads (none for a Hugging Face source), for manifests."""
    return _resolve_files(source["path"]) if source.get("kind", "local") == "local" else []


def source_label(source: dict) -> str:
    """How messages name a source: ``hf:<path>[/<name>]:<split>``, or a local source's path."""
    if source.get("kind", "local") != "hf":
        return str(source.get("path"))
    name = source.get("name")
    return f"hf:{source['path']}" + (f"/{name}" if name else "") + f":{source.get('split', 'train')}"


def iter_rows(source: dict) -> Iterator[tuple[dict, str]]:
    """Yield (row dict, origin) from a source spec; see the module docstring for the spec."""
    kind = source.get("kind", "local")
    if kind == "local":
        if "path" not in source:
            raise DataError(f"local source needs a 'path': {source}")
        for path in _resolve_files(source["path"]):
            yield from _read_local(path)
    elif kind == "hf":
        import datasets

        name = source.get("name")
        split = source.get("split", "train")
        label = source_label(source)
        try:
            ds = datasets.load_dataset(
                source["path"], name, split=split, streaming=True, revision=source.get("revision")
            )
        except Exception as e:  # network, auth, unknown config: say which source failed
            raise DataError(f"{label}: cannot open dataset ({type(e).__name__}: {e})") from e
        rows, i = iter(ds), 0
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # a stream can fail part-way (network, rate limit): say where
                raise DataError(f"{label}: reading failed after row {i} ({type(e).__name__}: {e})") from e
            i += 1
            yield row, f"{label}: row {i}"
    else:
        raise DataError(f"unknown source kind {kind!r} (want 'hf' or 'local'): {source}")


def column_text(row: dict, col: str, origin: str, *, required: bool = True) -> str:
    """The text in column ``col`` of a row; a missing or non-text value is a DataError naming ``origin``
    (optional columns read as "")."""
    if col not in row:
        if not required:
            return ""
        raise DataError(f"{origin}: missing column {col!r} (have {sorted(row)})")
    val = row[col]
    if val is None and not required:
        return ""
    if not isinstance(val, str):
        raise DataError(f"{origin}: column {col!r} is {type(val).__name__}, expected text")
    return val


def iter_documents(source: dict) -> Iterator[tuple[str, str]]:
    """Yield (text, origin) for every row of the source, reading ``source['text_column']`` (default text)."""
    col = source.get("text_column", "text")
    for row, origin in iter_rows(source):
        yield column_text(row, col, origin), origin
