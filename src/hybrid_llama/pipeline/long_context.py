"""The config seen by the long-context evaluations: the recommended variant, which result slots run
the long lengths, and the held-out books (the mirror's directory, or the Hub's books that rule
books_download writes in the same layout).

An 8K forward of a 135M model costs about a minute on one CPU core, so the lengths of
``quality.long_context.from_len`` tokens and more run only for the slots listed per kind under
``quality.long_context.slots`` ('recommended' stands for the top-level ``recommended`` variant);
every other slot runs the shorter lengths of the same evaluation. A slot with no length left runs no
job of that kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_llama.books import book_names, gutenberg_id
from hybrid_llama.config import canonical
from hybrid_llama.names import CORPUS_PARTS, SHARED_STAGES

from .paths import LONG_CONTEXT_KINDS, PATHS, path

if TYPE_CHECKING:  # views imports this module
    from .views import Pipeline

__all__ = ["book_files", "books_dir", "books_hub_source", "books_source", "hub_book_files", "hub_books",
           "kind_settings", "long_slots", "passkey_variants", "quality_lens", "recommended", "slot_settings",
           "throughput_long", "trains_on_books", "training_book_files", "uses_books", "with_recommended",
           "check_long_context"]


def recommended(p: Pipeline) -> str | None:
    """The recommended variant's name (config ``recommended``), or None."""
    return p.config.get("recommended")


def with_recommended(p: Pipeline, names: list[str]) -> list[str]:
    """``names`` with 'recommended' replaced by the variant it names (dropped when none is set)."""
    rec = recommended(p)
    return [rec if n == "recommended" else n for n in names if n != "recommended" or rec is not None]


def kind_settings(p: Pipeline, kind: str) -> dict[str, Any]:
    """The config section of a quality kind: ``quality.<kind>``, or ``quality.long_context.<kind>``
    for the long-context evaluations (books, niah)."""
    quality = p.config["quality"]
    return quality[kind] if kind in quality and kind != "long_context" else quality["long_context"][kind]


def long_slots(p: Pipeline, kind: str) -> list[str]:
    """The slots that run the long lengths of ``kind`` ('recommended' resolved; dropped when unset)."""
    return with_recommended(p, p.config["quality"]["long_context"]["slots"][kind])


def passkey_variants(p: Pipeline) -> list[str] | None:
    """The variants that run the passkey test (``quality.passkey.variants``, 'recommended' resolved and
    dropped when unset); None: every variant. Base's and base_lora's slots always run it."""
    named = p.config["quality"]["passkey"].get("variants")
    return None if named is None else with_recommended(p, named)


def quality_lens(p: Pipeline, kind: str, slot: str) -> list[int]:
    """The context lengths ``slot`` evaluates for ``kind``: all of them, or for the long-context kinds
    the short ones unless ``slot`` runs the long lengths; none for a variant the passkey test leaves out."""
    if kind == "passkey" and slot not in SHARED_STAGES and (named := passkey_variants(p)) is not None \
            and slot not in named:
        return []
    lens = [int(n) for n in kind_settings(p, kind)["context_lens"]]
    start = p.config["quality"]["long_context"]["from_len"]
    if kind not in LONG_CONTEXT_KINDS or start is None or slot in long_slots(p, kind):
        return lens
    return [n for n in lens if n < int(start)]


def slot_settings(p: Pipeline, kind: str, slot: str) -> dict[str, Any]:
    """A quality job's params: the kind's section with the slot's own context lengths; for the
    books also ``anchor_len``, the longest configured length, which places every slot's windows."""
    # which variants run the test is not a setting of any one job: listing another reruns no other job
    settings = {k: v for k, v in kind_settings(p, kind).items() if k != "variants"}
    extra = {"anchor_len": max(settings["context_lens"], default=0)} if kind == "books" else {}
    return canonical({**settings, "context_lens": quality_lens(p, kind, slot), **extra})


def books_dir(p: Pipeline) -> Path:
    """Where the book jobs find ``<name>.txt``: the mirror's directory, or the Hub books' (books_download)."""
    if p.data_kind("books") == "hf":
        return Path(PATHS["book"]).parent
    return p.local_data_path(p.config["data"]["books"]["local"])


def hub_books(p: Pipeline) -> dict[str, str]:
    """``{name: Project Gutenberg ebook id}`` of the books taken from the Hub (``data.books.names``)."""
    return {name: gutenberg_id(name) for name in p.config["data"]["books"]["names"]}


def books_hub_source(p: Pipeline) -> dict[str, Any]:
    """The ``hybrid_llama.sources`` spec of the books' Hub data set, with its id and text columns."""
    return canonical({"kind": "hf", **p.config["data"]["books"]["hf"]})


def hub_book_files(p: Pipeline) -> list[str]:
    """The files books_download writes: every book of ``data.books.names``, as the mirror has them."""
    return [path("book", book=name) for name in p.config["data"]["books"]["names"]]


def books_source(p: Pipeline) -> dict[str, Any]:
    """What the book jobs read: ``{dir, heldout}`` (hybrid_llama.books.heldout_books)."""
    return canonical({"dir": str(books_dir(p)), "heldout": list(p.config["data"]["books"]["heldout"])})


def book_files(p: Pipeline) -> list[str]:
    """The held-out books' files, as job inputs (a changed book reruns its evaluations)."""
    return [str(books_dir(p) / f"{name}.txt") for name in p.config["data"]["books"]["heldout"]]


def training_book_files(p: Pipeline) -> list[str]:
    """The training books' files (every book not held out: the mirror directory's other books, or
    the other ``data.books.names`` from the Hub), as inputs of the book rows."""
    heldout = set(p.config["data"]["books"]["heldout"])
    if p.data_kind("books") == "hf":
        return [path("book", book=n) for n in p.config["data"]["books"]["names"] if n not in heldout]
    directory = books_dir(p)
    return [str(directory / f"{n}.txt") for n in book_names(directory) if n not in heldout]


def trains_on_books(p: Pipeline) -> list[str]:
    """The variants whose transfer or distillation rows are cut (all or half) from the training books,
    or whose distillation adds recall rows (which are set in the training books too)."""
    transfers = [v for v in p.transfer_slots() if "books" in CORPUS_PARTS[p.transfer(v)["corpus"]]]
    distills = [v for v in p.lora_slots() if "books" in CORPUS_PARTS.get(p.lora_corpus(v), ())
                or p.recall_wildcards(v) is not None]
    return list(dict.fromkeys(transfers + distills))


def uses_books(p: Pipeline) -> bool:
    """Whether any job reads the books: NLL on them, a needle test with a book haystack, or training."""
    return (bool(kind_settings(p, "books")["context_lens"]) or "book" in kind_settings(p, "niah")["haystacks"]
            or bool(trains_on_books(p)))


def check_long_context(p: Pipeline) -> None:
    """ConfigError for a recommended variant or a long-length slot that names no variant, for a book
    name (data.books.names) that is not pg<ebook number>, and, when an evaluation reads the books, for
    held-out books the Hub would not provide (source hf or auto) or the mirror's directory lacks (when
    it is read)."""
    from hybrid_llama.config import ConfigError

    rec = recommended(p)
    if rec is not None and rec not in p.variants:
        raise ConfigError("recommended", f"'{rec}' is not a variant (variants: {sorted(p.variants)})")
    unknown = [v for v in throughput_long(p)["variants"] if v not in p.variants]
    if unknown:
        raise ConfigError("throughput.long.variants", f"{unknown} name no variant (variants: {sorted(p.variants)})")
    untimed = [v for v in throughput_long(p)["variants"] if v not in p.throughput_variants()]
    if untimed:
        raise ConfigError("throughput.long.variants", f"{untimed} are not timed at all (throughput.variants)")
    unknown = [v for v in p.config["quality"]["passkey"].get("variants") or [] if v not in {*p.variants, "recommended"}]
    if unknown:
        raise ConfigError("quality.passkey.variants", f"{unknown} name no variant (variants: {sorted(p.variants)})")
    known = {*p.variants, *SHARED_STAGES, "recommended"}
    for kind in LONG_CONTEXT_KINDS:
        unknown = [s for s in p.config["quality"]["long_context"]["slots"][kind] if s not in known]
        if unknown:
            raise ConfigError(f"quality.long_context.slots.{kind}",
                              f"{unknown} name no result slot (base, base_lora, a variant or 'recommended')")
    books = p.config["data"]["books"]
    for i, name in enumerate(books["names"]):  # always: rule books_download maps them at parse time
        try:
            gutenberg_id(name)
        except ValueError as e:
            raise ConfigError(f"data.books.names[{i}]", str(e)) from None
    if not uses_books(p):
        return
    # 'auto' resolves per machine, so a config with it must also hold where the Hub is read
    trainers = trains_on_books(p)
    if books["source"] != "local":
        absent = [b for b in books["heldout"] if b not in books["names"]]
        if absent:
            raise ConfigError("data.books.heldout", f"{absent} are not among the books taken from the Hub "
                                                    f"(data.books.names: {books['names']})")
        if trainers and set(books["names"]) <= set(books["heldout"]):
            raise ConfigError("data.books.heldout", f"every book of data.books.names is held out, and {trainers} "
                                                    "train on the others (corpus: books)")
    if p.data_kind("books") == "hf":
        return  # the files come from rule books_download
    directory = books_dir(p)
    if not directory.is_dir():
        raise ConfigError("data.books.local", f"{directory} is not a directory (shared_data = {p.shared_data()})")
    missing = [f for f in book_files(p) if not Path(f).is_file()]
    if missing:
        raise ConfigError("data.books.heldout", f"no such book: {missing} (the books are the *.txt of {directory})")
    if trainers and not training_book_files(p):
        raise ConfigError("data.books.heldout", f"every book of {directory} is held out, and {trainers} train on "
                                                "the others (corpus: books)")


def throughput_long(p: Pipeline) -> dict[str, Any]:
    """``throughput.long`` with 'recommended' resolved to the variant it names (dropped when unset)."""
    long = dict(p.config["throughput"]["long"])
    long["variants"] = with_recommended(p, long["variants"])
    return canonical(long)
