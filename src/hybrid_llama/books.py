"""The long-document corpus: public-domain books (Project Gutenberg plain text), split by book.

A book is held out whole or not at all: windows cut from one book share its names, style and plot,
so a split by position inside a book would let training see the evaluation's text. The split is the
list of held-out book names in the config (file stems, e.g. ``pg1342``); every other book of the
directory is available for training. Project Gutenberg's header and licence footer are cut off.
"""

from __future__ import annotations

import re
from pathlib import Path

# The markers Project Gutenberg puts around a book's own text (several spellings over the years).
_START = re.compile(r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK[^\n]*\*{3}[^\n]*$",
                    re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\s*(?:\*{3}\s*)?END OF (?:THE|THIS) PROJECT GUTENBERG E-?BOOK", re.IGNORECASE | re.MULTILINE)
# Older editions end the text with "End of (the) Project Gutenberg's <title>" and no *** marker.
_OLD_END = re.compile(r"^\s*End of (?:the )?Project Gutenberg'?s?\b", re.IGNORECASE | re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """The book's own text: everything between the START and END markers (when present), without
    the older "End of Project Gutenberg's ..." trailer, with the line breaks normalised to \\n and
    the surrounding blank lines removed."""
    text = text.replace("\r\n", "\n").lstrip("\ufeff")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text) or _OLD_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


# A book's name is its mirror file stem: pg<N> for Project Gutenberg ebook N (no leading zeros, as
# Gutenberg numbers them), which is how the Hub data sets identify the same book.
_GUTENBERG_NAME = re.compile(r"pg([1-9][0-9]*)")


def gutenberg_id(name: str) -> str:
    """The Project Gutenberg ebook number a book name stands for (``pg1342`` -> ``"1342"``); ValueError
    for a name of any other form."""
    m = _GUTENBERG_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"{name!r} is not a Project Gutenberg book name (pg<ebook number>, e.g. pg1342)")
    return m.group(1)


def book_names(directory: str | Path) -> list[str]:
    """The books of a directory: the stems of its ``*.txt`` files, sorted."""
    return sorted(p.stem for p in Path(directory).glob("*.txt"))


def split_books(names: list[str], heldout: list[str]) -> dict[str, list[str]]:
    """``{"heldout": [...], "train": [...]}``: the held-out books as listed (sorted), every other one
    for training. Raises ValueError for a held-out name that is not a book, or when none is left for
    either side."""
    unknown = sorted(set(heldout) - set(names))
    if unknown:
        raise ValueError(f"held-out books {unknown} are not among the books {sorted(names)}")
    held = sorted(set(heldout))
    if not held:
        raise ValueError("no held-out book: list at least one")
    return {"heldout": held, "train": sorted(set(names) - set(held))}


def read_books(directory: str | Path, names: list[str]) -> list[str]:
    """The stripped texts of the named books of ``directory``, in the order given."""
    directory = Path(directory)
    texts = []
    for name in names:
        file = directory / f"{name}.txt"
        if not file.is_file():
            raise FileNotFoundError(f"book {name!r}: {file} does not exist")
        text = strip_gutenberg(file.read_text(encoding="utf-8", errors="replace"))
        if not text:
            raise ValueError(f"book {name!r} ({file}) is empty once the Project Gutenberg boilerplate is cut")
        texts.append(text)
    return texts


def heldout_books(directory: str | Path, heldout: list[str]) -> list[str]:
    """The held-out books' texts (``split_books`` of the directory's books; boilerplate cut)."""
    return read_books(directory, split_books(book_names(directory), heldout)["heldout"])


def training_books(directory: str | Path, heldout: list[str]) -> list[str]:
    """The texts of every book not held out: what a long-context training recipe may use."""
    return read_books(directory, split_books(book_names(directory), heldout)["train"])
