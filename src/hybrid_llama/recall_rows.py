"""Recall rows: running text of a training book with a few facts set in it, asked for at the row's end.

Prose seldom makes a model fetch an exact token from a thousand tokens back, so a distillation on
documents or book rows trains that little, and a hybrid that matches base on prose can still lose
the passkey. A recall row is a run of a training book with ``facts`` short statements ("Mara's
locker number is 40713.") set at sentence starts, then one question per fact, each answered with its
value (with ``lora.recall_asks`` > 1, also in question blocks inside the row; with
``lora.recall_same_attribute``, every fact of a row states one attribute; with
``lora.recall_subjects: words``, the facts belong to things named by one common word, "The cedar
box's serial number is 40713.", instead of to people). The distillation
(``lora.recall_rows``) scores every position as usual and weights the
positions that predict an answer token by ``lora.answer_weight``: there the teacher reads the
fact back from far away.

The wording is this module's own: its names, attributes and sentences are none of the passkey's or
the needle test's, and the books are the training books, so no evaluation prompt is trained on.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybrid_llama.books import book_names, read_books, split_books
from hybrid_llama.data import DataError, _load_tokenizer, _tokenizer_name, _write_outputs
from hybrid_llama.eval.niah import insert_pieces
from hybrid_llama.files import load_safetensors

__all__ = ["recall_row", "prepare_recall_rows", "load_recall_rows", "answer_positions"]

# Self-written: people's names and what a number of theirs is.
NAMES = (
    "Mara", "Tobias", "Ines", "Oskar", "Leona", "Felix", "Greta", "Hugo", "Alma", "Jonas", "Clara", "Emil",
    "Rosa", "Viktor", "Nora", "Anton", "Ida", "Lukas", "Selma", "Paul", "Vera", "Otto", "Lena", "Arvid",
)
ATTRIBUTES = (
    "locker number", "ticket number", "room number", "phone extension", "order number", "seat number",
    "badge number", "parcel number",
)
# Self-written, for ``subjects="words"``: things told apart by one common word, as the multi-key
# needles' keys are (none of those key words), and what a number of theirs is.
WORDS = (
    "acorn", "barrel", "basket", "beacon", "bucket", "cedar", "chisel", "clover", "cobalt", "compass",
    "cotton", "feather", "granite", "hammer", "honey", "ivory", "juniper", "ladder", "lemon", "maple",
    "marble", "olive", "pebble", "thistle",
)
WORD_ATTRIBUTES = (
    "serial number", "lot number", "shelf number", "tag number", "stock number", "batch number",
    "crate number", "code number",
)
SUBJECTS = {"names": (NAMES, ATTRIBUTES), "words": (WORDS, WORD_ATTRIBUTES)}


def owner_text(owner: str, subjects: str, *, start: bool) -> str:
    """Whose number it is: "Mara's", or "The cedar box's" (``start``: at a sentence start)."""
    if subjects == "names":
        return f"{owner}'s"
    return f"{'The' if start else 'the'} {owner} box's"


def fact_text(owner: str, attribute: str, value: str, subjects: str = "names") -> str:
    return f" {owner_text(owner, subjects, start=True)} {attribute} is {value}."


def question_text(owner: str, attribute: str, subjects: str = "names") -> str:
    asked, again = owner_text(owner, subjects, start=False), owner_text(owner, subjects, start=True)
    return f" Question: what is {asked} {attribute}? Answer: {again} {attribute} is"


def recall_row(tokenizer: Any, book_ids: Sequence[int], seq_len: int, facts: int,
               rng: random.Random, asks: int = 1, same_attribute: bool = False,
               subjects: str = "names") -> tuple[list[int], list[bool], list[dict]]:
    """One row of exactly ``seq_len`` tokens: a run of ``book_ids`` from a random offset with
    ``facts`` facts at random depths (snapped to sentence starts), then the questions in a random
    order, each followed by its value and a full stop. With ``asks`` > 1 the row also asks in its
    middle: a question block at depth k / asks of the haystack (k = 1 .. asks - 1) asks for the facts
    set since the block before it, so that questions are trained at mid-row positions and at shorter
    distances too, as a prompt of half the row's length would ask them. The end still asks for every
    fact. With ``same_attribute`` every fact states one attribute ("Mara's room number", "Hugo's
    room number"), so only the names tell the facts apart, as only the keys tell the multi-key
    needles apart. ``subjects`` says whose the facts are: ``names``, people's, or ``words``, things
    named by one common word ("The cedar box's serial number"); the draws are the same, so a row of
    either kind on one seed differs only in its wording. Returns (ids, answer flags per token, the
    facts with their value's token spans: ``answer_at`` at the end, ``mid_answer_at`` in a middle
    block, where one asks)."""
    if asks < 1:
        raise ValueError(f"asks={asks}: a recall row asks at least once, at its end")
    if subjects not in SUBJECTS:
        raise ValueError(f"subjects={subjects!r}: one of {sorted(SUBJECTS)}")
    pool, attributes = SUBJECTS[subjects]
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    owners = rng.sample(pool, facts)
    attrs = [rng.choice(attributes)] * facts if same_attribute else [rng.choice(attributes) for _ in owners]
    values = [str(rng.randrange(10 ** (d - 1), 10**d)) for d in (rng.randint(3, 6) for _ in owners)]
    pieces = [encode(fact_text(n, a, v, subjects)) for n, a, v in zip(owners, attrs, values)]
    order = rng.sample(range(facts), facts)

    def questions(asked: Sequence[int], head: list[int]) -> tuple[list[int], dict[int, tuple[int, int]]]:
        """``head`` then a question on each fact of ``asked`` with its value; the values' spans in it."""
        spans = {}
        for i in asked:
            head = head + encode(question_text(owners[i], attrs[i], subjects))
            value = encode(f" {values[i]}")
            spans[i] = (len(head), len(head) + len(value))
            head = head + value + encode(".")
        return head, spans

    # facts in the first 90 % of the haystack: most answers lie far beyond a 64-token window
    draw_depths = lambda: [rng.uniform(0.0, 0.9) for _ in owners]  # noqa: E731
    # middle blocks are placed by the facts' depths, so those are drawn before the haystack's start;
    # one ask keeps the draw order of the rows made before ``asks`` existed
    depths = draw_depths() if asks > 1 else None
    blocks, block_depths, block_spans = [], [], []
    for k in range(1, asks):
        lo, hi = (k - 1) / asks, k / asks
        asked = [i for i in order if lo <= depths[i] < hi]
        if asked:
            # a paragraph of its own; the book resumes on a new line after it
            block, asked_spans = questions(asked, encode("\n"))
            blocks.append(block + encode("\n"))
            block_depths.append(hi)
            block_spans.append(asked_spans)
    tail, answer_spans = questions(order, encode("\n"))  # the questions start a paragraph of their own
    n_hay = seq_len - sum(map(len, pieces + blocks)) - len(tail)
    if n_hay < 16 * facts:
        raise ValueError(f"{facts} facts and their questions take {seq_len - n_hay} of a {seq_len}-token row")
    if len(book_ids) < n_hay:
        raise ValueError(f"a book of {len(book_ids)} tokens is shorter than the {n_hay}-token haystack")
    start = rng.randint(0, len(book_ids) - n_hay)
    if depths is None:
        depths = draw_depths()
    # facts are listed before the blocks, so a fact snapped to a block's sentence start stays before it
    body, spans = insert_pieces(tokenizer, list(book_ids[start : start + n_hay]), pieces + blocks,
                                depths + block_depths)
    ids = body + tail
    answer = [False] * len(ids)

    def flag(offset: int, spans_in: dict[int, tuple[int, int]]) -> None:
        for a, b in spans_in.values():
            answer[offset + a : offset + b] = [True] * (b - a)

    mid_answer_at = {}
    for (offset, _), spans_of_block in zip(spans[facts:], block_spans):
        flag(offset, spans_of_block)
        mid_answer_at.update({i: offset + a for i, (a, _) in spans_of_block.items()})
    flag(len(body), answer_spans)
    records = [{"name": owners[i], "attribute": attrs[i], "value": values[i], "fact_at": spans[i][0],
                "answer_at": len(body) + answer_spans[i][0]} for i in range(facts)]
    for i, at in mid_answer_at.items():
        records[i]["mid_answer_at"] = at
    assert len(ids) == seq_len
    return ids, answer, records


def answer_positions(answers: torch.Tensor) -> torch.Tensor:
    """Where a next-token loss predicts an answer token: position t of a row scores token t + 1."""
    out = torch.zeros_like(answers, dtype=torch.bool)
    out[:, :-1] = answers[:, 1:].bool()
    return out


def prepare_recall_rows(books: dict, tokenizer: Any, out_path: str | os.PathLike, *, seq_len: int, rows: int,
                        facts: int, asks: int = 1, same_attribute: bool = False, subjects: str = "names",
                        seed: int = 0) -> dict:
    """``rows`` recall rows of ``seq_len`` tokens on the training books (``books``: ``{dir, heldout}``,
    every book of the directory not held out), the books taken in turn, each row asking in
    ``asks`` places, its facts of one attribute or each of its own, people's or things'
    (``recall_row``); returns the manifest.
    Writes ``out_path`` (safetensors ``tokens`` int32 and ``answers`` uint8, both ``[rows, seq_len]``)
    and the JSON manifest beside it, which records each row's book, facts and answer positions."""
    directory = Path(books["dir"])
    names = split_books(book_names(directory), list(books["heldout"]))["train"]
    if not names:
        raise DataError(f"{directory}: every book is held out (data.books.heldout); none is left to train on")
    tok = _load_tokenizer(tokenizer)
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text in read_books(directory, names)]
    rng = random.Random(f"recall:{seed}")
    tokens, answers, records = [], [], []
    for r in range(int(rows)):
        b = r % len(names)
        row, answer, facts_of_row = recall_row(tok, ids[b], int(seq_len), int(facts), rng, int(asks),
                                               bool(same_attribute), subjects)
        tokens.append(row)
        answers.append(answer)
        records.append({"book": names[b], "facts": facts_of_row})
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int32).reshape(-1, int(seq_len)),
               "answers": torch.tensor(answers, dtype=torch.uint8).reshape(-1, int(seq_len))}
    manifest = {
        "kind": "recall_rows",
        "source": {"dir": str(directory), "heldout": sorted(books["heldout"])},
        "seq_len": int(seq_len),
        "num_sequences": int(rows),
        "facts_per_row": int(facts),
        "asks_per_row": int(asks),
        "same_attribute": bool(same_attribute),
        "subjects": subjects,
        "seed": int(seed),
        "answer_tokens": int(tensors["answers"].sum()),
        "rows": records,
        "tokenizer": _tokenizer_name(tok),
    }
    _write_outputs(Path(out_path), tensors, manifest)
    return manifest


def load_recall_rows(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 ``[N, L]``, answer flags bool ``[N, L]``) of a ``prepare_recall_rows`` file."""
    t = load_safetensors(path, rule="recall_rows")
    if "tokens" not in t or "answers" not in t:
        raise DataError(f"{path}: not a recall-rows file (keys {sorted(t)})")
    return t["tokens"].long(), t["answers"].bool()
