"""The long-document books from the Hugging Face Hub, written as the offline mirror's ``<name>.txt`` files.

On the Hub the books are rows of a Project Gutenberg data set: the ebook number in an id column, the
raw ebook in a text column. The split is streamed in its stored order and the stream is left as soon
as every requested id has been seen; an id that no row carries therefore costs a pass over the whole
split (tens of thousands of books for English) before the error. The text is written unchanged,
header and licence included: ``hybrid_llama.books`` cuts them when it reads a book, so the evaluations
read a Hub file exactly as they read a mirror file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import atomic_write, sha256_of
from .sources import DataError, column_text, iter_rows, source_label

__all__ = ["HubBook", "find_books", "write_books"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubBook:
    """One book as the Hub row holds it: its ebook id, raw text and the row it came from."""

    id: str
    text: str
    origin: str


def find_books(source: dict, ids: dict[str, str]) -> dict[str, HubBook]:
    """``{name: HubBook}`` for ``ids`` (``{name: ebook id}``), from the rows of ``source``: a ``kind: hf``
    spec of ``hybrid_llama.sources`` plus ``id_column`` and ``text_column``. Reads until every id is
    found (the first row of an id wins) and raises DataError naming the ids that no row carries."""
    wanted = {book_id: name for name, book_id in ids.items()}
    if len(wanted) != len(ids):
        raise ValueError(f"two books share an ebook id: {ids}")
    id_column, text_column = source.get("id_column", "id"), source.get("text_column", "text")
    found: dict[str, HubBook] = {}
    rows = 0
    if wanted:
        for row, origin in iter_rows(source):
            rows += 1
            if id_column not in row:
                raise DataError(f"{origin}: missing column {id_column!r} (have {sorted(row)})")
            # ids are strings on the Hub; str() also accepts a data set that stores them as integers
            name = wanted.get(str(row[id_column]).strip())
            if name is None or name in found:
                continue
            found[name] = HubBook(ids[name], column_text(row, text_column, origin), origin)
            log.info("%s: ebook %s (%s), %d characters", origin, ids[name], name, len(found[name].text))
            if len(found) == len(wanted):
                break
    missing = {name: book_id for name, book_id in ids.items() if name not in found}
    if missing:
        raise DataError(f"{source_label(source)}: no row has {id_column} "
                        f"{', '.join(repr(i) for i in missing.values())} (books {sorted(missing)}) in all {rows} rows")
    return found


def write_books(books: dict[str, HubBook], directory: str | Path) -> dict[str, dict[str, Any]]:
    """Write each book's text, unchanged, to ``directory/<name>.txt``; return what a manifest records
    of each: ``{name: {id, row, sha256}}``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, book in sorted(books.items()):
        file = directory / f"{name}.txt"
        atomic_write(file, book.text.encode("utf-8"))  # bytes: line ends stay as the Hub has them
        out[name] = {"id": book.id, "row": book.origin, "sha256": sha256_of(file)}
    return out
