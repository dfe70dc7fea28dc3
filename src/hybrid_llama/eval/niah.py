"""Multi-key needle in a haystack (after RULER's ``niah_multikey``): several key-value needles, one question.

Each trial hides ``n_keys`` needles "The special magic number for KEY is VALUE." in a haystack and
asks for the value of one of them; the model answers by greedy generation with its cache, and the
trial counts as found only when the queried value appears as a whole number in the answer. A model
that answers another needle's value scores 0 (``answered_key`` records whose value it gave, and
``answered_distance`` how far back that needle lay: a model that reads *a* needle back without
matching its key answers the ones nearer the question). The
keys are distinct words, the values distinct 7-digit numbers; the queried needle's depth is spread
over the trials of a length, the others are placed at seeded random depths.

Two haystacks: ``filler`` (the passkey's self-written sentences, repeated) and ``book`` (running
text of a held-out book from a seeded offset, the realistic case: the needles look like the story).
Prompts are built token-exact, so every length is exactly its context. Rows (``NIAH_COLUMNS`` in
``hybrid_llama.eval.tables``) go to ``niah.csv``; the report counts the needles beyond the window apart.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Sequence

import torch

from hybrid_llama.eval.passkey import _encode, _special_prefix, filler_ids, fitted_length, spread_depths
from hybrid_llama.eval.placement import eval_mode, max_positions, place_model

HAYSTACKS = ("filler", "book")
NIAH_INTRO = ("Some special magic numbers are hidden in the text below. Memorize them: you will be asked "
              "about one of them.")
# Self-written key words: common, single-sense, none a number.
KEY_WORDS = (
    "apple", "anchor", "badger", "bamboo", "candle", "canyon", "copper", "dolphin", "ember", "falcon",
    "garden", "glacier", "harbor", "helmet", "island", "jacket", "kettle", "lantern", "meadow", "mirror",
    "nickel", "orchid", "pepper", "pillow", "quartz", "rabbit", "saddle", "silver", "tiger", "tulip",
    "velvet", "violin", "walnut", "willow", "yogurt", "zebra",
)


def needle_text(key: str, value: str) -> str:
    return f" The special magic number for {key} is {value}."


def question_text(key: str) -> str:
    return f" What is the special magic number for {key}? The special magic number for {key} is"


def haystack_ids(tokenizer, kind: str, n_tokens: int, seed: int, book_ids: Sequence[int] | None = None) -> list[int]:
    """``n_tokens`` of haystack: seeded filler, or a run of ``book_ids`` from a seeded offset."""
    if kind == "filler":
        return filler_ids(tokenizer, n_tokens, seed)
    if kind != "book":
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {kind!r}")
    if book_ids is None or len(book_ids) < n_tokens:
        raise ValueError(f"a book haystack of {n_tokens} tokens needs a book at least that long "
                         f"(got {0 if book_ids is None else len(book_ids)} tokens)")
    start = random.Random(f"book:{seed}").randint(0, len(book_ids) - n_tokens)
    return list(book_ids[start : start + n_tokens])


def sentence_starts(tokenizer, ids: Sequence[int]) -> list[int]:
    """Positions in ``ids`` right after a token that ends a sentence or a line: where a needle reads
    as a sentence of its own."""
    ends = tuple(".!?\n")
    return [i + 1 for i, t in enumerate(ids) if tokenizer.decode([t]).rstrip(" ").endswith(ends)]


def _snap(cut: int, starts: Sequence[int], n: int) -> int:
    """The first sentence start at or after ``cut`` (the last one before it when none follows)."""
    after = [b for b in starts if cut <= b <= n]
    before = [b for b in starts if b <= min(cut, n)]
    return after[0] if after else before[-1] if before else cut


def insert_pieces(tokenizer, haystack: Sequence[int], pieces: Sequence[Sequence[int]], depths: Sequence[float],
                  *, snap: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """``haystack`` with ``pieces[i]`` inserted at ``depths[i]`` of it (a share of the haystack before
    it; with ``snap``, moved to the next sentence start). Returns (ids, spans) with ids[start:end]
    the tokens of piece i for ``spans[i] = (start, end)``."""
    n = len(haystack)
    cuts = [round(float(d) * n) for d in depths]
    if snap:
        starts = sentence_starts(tokenizer, haystack)
        cuts = [_snap(c, starts, n) for c in cuts]
    ids: list[int] = []
    spans: list[tuple[int, int]] = [(0, 0)] * len(pieces)
    pos = 0
    for i in sorted(range(len(pieces)), key=lambda i: (cuts[i], i)):
        ids += haystack[pos : cuts[i]]
        pos = cuts[i]
        spans[i] = (len(ids), len(ids) + len(pieces[i]))
        ids += pieces[i]
    return ids + list(haystack[pos:]), spans


def make_niah_prompt(tokenizer, *, context_len: int, needles: Sequence[tuple[str, str]], depths: Sequence[float],
                     query: int, haystack: Sequence[int],
                     snap: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt of exactly ``context_len`` tokens: [BOS] intro, the haystack with needle i inserted
    at ``depths[i]`` of it (a share of the haystack before it; with ``snap``, moved to the next
    sentence start), then the question about ``needles[query]``. Returns (ids, spans) with
    ids[start:end] the tokens of needle i for ``spans[i] = (start, end)``. Raises ValueError when
    the fixed parts do not fit; ``haystack`` must hold at least the rest."""
    head = _special_prefix(tokenizer) + _encode(tokenizer, NIAH_INTRO)
    pieces = [_encode(tokenizer, needle_text(k, v)) for k, v in needles]
    question = _encode(tokenizer, question_text(needles[query][0]))
    n_hay = context_len - len(head) - sum(map(len, pieces)) - len(question)
    if n_hay < 0:
        raise ValueError(f"a {len(needles)}-key prompt cannot fit in {context_len} tokens "
                         f"(its fixed parts take {context_len - n_hay})")
    hay = list(haystack[:n_hay])
    if len(hay) < n_hay:
        raise ValueError(f"haystack has {len(haystack)} tokens, the prompt needs {n_hay}")
    ids, spans = insert_pieces(tokenizer, hay, pieces, depths, snap=snap)
    ids = head + ids + question
    assert len(ids) == context_len
    return ids, [(len(head) + start, len(head) + end) for start, end in spans]


def niah_trials(tokenizer, *, context_len: int, trials: int, n_keys: int, haystack: str, seed: int = 0,
                book_ids: Sequence[int] | None = None) -> list[dict]:
    """The trials of one length and haystack: each its own keys, values, depths and haystack.

    A trial: ``prompt`` (ids), ``needles`` [(key, value)], ``query`` (the index asked about),
    ``key``/``value`` (the queried needle), ``depth`` (its depth, spread over the trials),
    ``distances`` (tokens from the end of each needle to the end of the prompt) and
    ``needle_distance`` (the queried needle's)."""
    if n_keys > len(KEY_WORDS):
        raise ValueError(f"n_keys {n_keys}: only {len(KEY_WORDS)} key words")
    out = []
    for trial, depth in enumerate(spread_depths(trials)):
        rng = random.Random(f"niah:{seed}:{haystack}:{context_len}:{trial}")
        keys = rng.sample(KEY_WORDS, n_keys)
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_keys)]
        query = rng.randrange(n_keys)
        depths = [depth if i == query else rng.random() for i in range(n_keys)]
        hay = haystack_ids(tokenizer, haystack, context_len, seed * 1000 + trial, book_ids)
        ids, spans = make_niah_prompt(tokenizer, context_len=context_len, needles=list(zip(keys, values)),
                                      depths=depths, query=query, haystack=hay)
        distances = [context_len - end for _start, end in spans]
        out.append({"trial": trial, "prompt": ids, "needles": list(zip(keys, values)), "query": query,
                    "key": keys[query], "value": values[query], "depth": depth, "distances": distances,
                    "needle_distance": distances[query]})
    return out


def score_answer(answer: str, trial: dict) -> tuple[bool, str]:
    """(found, answered_key): found when the queried value is a whole number of ``answer``;
    answered_key is the key of the first needle value the answer gives ("" for none)."""
    numbers = re.findall(r"\d+", answer)
    by_value = {v: k for k, v in trial["needles"]}
    answered = next((by_value[n] for n in numbers if n in by_value), "")
    return trial["value"] in numbers, answered


@torch.no_grad()
def generate_answer(model, tokenizer, prompt: list[int], new_tokens: int, device) -> str:
    """Greedy continuation of ``prompt`` (with the model's cache), decoded without special tokens."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, use_cache=True, pad_token_id=pad)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def answer_tokens(tokenizer) -> int:
    """Tokens an answer is generated for: a 7-digit value, its full stop and some slack."""
    return len(_encode(tokenizer, " 1234567.")) + 3


def book_haystack(tokenizer, book_texts: Sequence[str]) -> list[int]:
    """The token ids a ``book`` haystack is cut from: the longest of the held-out books."""
    return max((_encode(tokenizer, t) for t in book_texts), key=len)


def niah_accuracy(
    model,
    tokenizer,
    *,
    context_lens: Sequence[int],
    trials: int = 12,
    n_keys: int = 4,
    haystacks: Sequence[str] = ("filler",),
    book_texts: Sequence[str] | None = None,
    seed: int = 0,
    stage: str,
    device=None,
    dtype=None,
) -> list[dict]:
    """One row per trial and haystack (``tables.NIAH_COLUMNS``), scored by greedy generation.

    ``book_texts``: the held-out books a ``book`` haystack is cut from (the longest one is used).
    A length whose prompt and answer would run past the model's positions takes a prompt shortened
    by the answer (``passkey.fitted_length``; rows keep the nominal length); longer ones are skipped."""
    dev = place_model(model, device, dtype)
    limit = max_positions(model)
    new_tokens = answer_tokens(tokenizer)
    book_ids = None
    if "book" in haystacks:
        if not book_texts:
            raise ValueError("a 'book' haystack needs book_texts (the held-out books)")
        book_ids = book_haystack(tokenizer, book_texts)
    rows = []
    with eval_mode(model):
        for hay in haystacks:
            for L in sorted(int(x) for x in context_lens):
                n = fitted_length(L, limit, new_tokens)
                if n is None:
                    warnings.warn(f"niah: skipping context {L}: above max_position_embeddings {limit}", stacklevel=2)
                    continue
                try:
                    cell = niah_trials(tokenizer, context_len=n, trials=trials, n_keys=n_keys, haystack=hay,
                                       seed=seed, book_ids=book_ids)
                except ValueError as e:
                    warnings.warn(f"niah: skipping {hay} context {L}: {e}", stacklevel=2)
                    continue
                for t in cell:
                    answer = generate_answer(model, tokenizer, t["prompt"], new_tokens, dev)
                    found, answered = score_answer(answer, t)
                    keys = [k for k, _ in t["needles"]]
                    answered_distance = t["distances"][keys.index(answered)] if answered else None
                    rows.append({"stage": stage, "haystack": hay, "context_len": L, "trial": t["trial"],
                                 "n_keys": n_keys, "depth": round(t["depth"], 6), "key": t["key"], "value": t["value"],
                                 "needle_distance": t["needle_distance"], "answer": answer.strip()[:40],
                                 "answered_key": answered, "answered_distance": answered_distance,
                                 "accuracy": float(found), "n": 1})
    return rows
