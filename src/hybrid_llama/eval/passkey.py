"""Passkey retrieval: a 5-digit key hidden in filler text at a chosen depth, read back by greedy decoding.

The hybrid's softmax window is short, so beyond it the key has to survive in the linear state.
Prompts are built token-exact (``make_passkey_prompt``) so every trial of a (length, depth) cell has
the same length and the cell batches without padding. The rows go to ``passkey.csv``
(``hybrid_llama.eval.tables``).
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Sequence

import torch

from hybrid_llama.eval.placement import eval_mode, max_positions, place_model

# Plain, self-written sentences: no download, no information a model could confuse with a key.
FILLER_SENTENCES = (
    "The grass is green and the sky is blue.",
    "A river runs slowly past the old stone bridge.",
    "Birds sing in the morning and rest in the evening.",
    "The baker opens the shop before the town wakes up.",
    "Clouds drift over the hills and the wind is calm.",
    "Children walk to school along the quiet road.",
    "The library keeps its doors open until late.",
    "Rain falls softly on the roofs of the village.",
    "A cat sleeps in the sun near the kitchen window.",
    "The farmer checks the fields after the harvest.",
    "Boats wait in the harbor for the tide to turn.",
    "The market fills with voices on Saturday morning.",
)
PASSKEY_INTRO = "There is a pass key hidden in the text below. Find it and remember it."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


# --------------------------------------------------------------------------- prompts


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_prefix(tokenizer) -> list[int]:
    """The BOS id if this tokenizer adds one by default (so prompts look like normal inputs)."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and len(with_special) > len(without) and with_special[0] == bos:
        return [bos]
    return []


def filler_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """At least n_tokens of seeded filler: rounds of the fixed sentences, each round shuffled."""
    rng = random.Random(seed)
    sentences: list[str] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        # double the text and re-tokenize: a few tokenizer calls even for 2^15-token prompts
        for _ in range(max(1, len(sentences) // len(FILLER_SENTENCES))):
            order = list(FILLER_SENTENCES)
            rng.shuffle(order)
            sentences.extend(order)
        ids = _encode(tokenizer, " " + " ".join(sentences))
    return ids[:n_tokens]


def passkey_parts(tokenizer, key: int | str) -> dict[str, list[int]]:
    """Token ids of the fixed prompt segments around the filler (each tokenized on its own)."""
    key = str(key)
    return {
        "head": _special_prefix(tokenizer) + _encode(tokenizer, PASSKEY_INTRO),
        "pre": _encode(tokenizer, " The pass key is"),
        "key": _encode(tokenizer, " " + key),
        "post": _encode(tokenizer, f". Remember it. {key} is the pass key."),
        "question": _encode(tokenizer, PASSKEY_QUESTION),
    }


def make_passkey_prompt(
    tokenizer, *, context_len: int, depth: float, key: int | str, seed: int = 0
) -> tuple[list[int], tuple[int, int]]:
    """Prompt of exactly `context_len` tokens with the key stated at `depth` of the filler.

    Layout: [BOS] intro | filler A | " The pass key is" " KEY" ". Remember it. KEY is the pass key." |
    filler B | " What is the pass key? The pass key is". Depth is the share of the filler that comes
    before the key: len(A) = round(depth * (len(A) + len(B))), so depth 0 puts the key right after
    the intro and depth 1 right before the question, at every length. (Measuring depth as
    key position / context_len instead would not fit 90% at 256 tokens: the text after the key
    alone is ~30 tokens.) The key's position / context_len approaches depth as the prompt grows
    and the fixed parts (~60 tokens) become a small share of it.
    Segments are tokenized separately and the filler is cut to the token, so lengths are exact.
    Returns (input_ids, (start, end)), input_ids[start:end] the key's tokens (first statement).
    Raises ValueError when the fixed parts alone do not fit.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    parts = passkey_parts(tokenizer, key)
    n_filler = context_len - sum(len(p) for p in parts.values())
    if n_filler < 0:
        raise ValueError(
            f"passkey prompt cannot fit in {context_len} tokens: its fixed parts take {context_len - n_filler}"
        )
    n_before = round(depth * n_filler)
    filler = filler_ids(tokenizer, n_filler, seed)
    ids = (parts["head"] + filler[:n_before] + parts["pre"] + parts["key"] + parts["post"]
           + filler[n_before:] + parts["question"])
    start = len(parts["head"]) + n_before + len(parts["pre"])
    assert len(ids) == context_len
    return ids, (start, start + len(parts["key"]))


def _trial_key(seed: int, context_len: int, depth: float, trial: int) -> int:
    # str seeds are hashed deterministically by random.Random (not by Python's salted hash()).
    return random.Random(f"{seed}:{context_len}:{depth}:{trial}").randint(10000, 99999)


def cell_prompts(
    tokenizer, *, context_len: int, depth: float, trials: int, seed: int
) -> tuple[list[list[int]], list[str]]:
    """(prompts, keys) of the `trials` trials of one (length, depth) cell: each trial its own key and
    filler order, all prompts `context_len` tokens. Raises ValueError when the prompt cannot fit."""
    prompts, keys = [], []
    for trial in range(trials):
        key = _trial_key(seed, context_len, depth, trial)
        ids, _ = make_passkey_prompt(tokenizer, context_len=context_len, depth=depth, key=key, seed=seed + trial)
        prompts.append(ids)
        keys.append(str(key))
    return prompts, keys


# --------------------------------------------------------------------------- scoring


def key_found(generated: str, key: str) -> bool:
    """The key counts as retrieved when it appears as a whole number in the continuation
    (so "12345." counts, "123456" does not)."""
    return key in re.findall(r"\d+", generated)


@torch.no_grad()
def _greedy_hits(model, tokenizer, prompts: list[list[int]], keys: list[str], *, new_tokens: int,
                 batch_size: int, device: torch.device) -> int:
    """How many of the prompts' greedy continuations (`new_tokens` long, with the KV cache) contain their key."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hits = 0
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size], dtype=torch.long, device=device)
        out = model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=pad,
        )
        for row, key in zip(out[:, batch.shape[1] :].tolist(), keys[i : i + batch_size]):
            hits += key_found(tokenizer.decode(row, skip_special_tokens=True), key)
    return hits


def passkey_accuracy(
    model,
    tokenizer,
    *,
    context_lens: Sequence[int],
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 20,
    seed: int = 0,
    device=None,
    stage: str,
    batch_size: int = 1,
    dtype=None,
) -> list[dict]:
    """Greedy-decode after each passkey prompt; a trial counts when the key's digits appear.

    Lengths whose prompt + answer exceed max_position_embeddings, or too short for the fixed
    prompt parts, are skipped with a warning (no row). All prompts of a cell have the same length,
    so they batch without padding. Rows: {stage, context_len, depth, accuracy, n}.
    """
    dev = place_model(model, device, dtype)
    limit = max_positions(model)
    rows = []
    with eval_mode(model):
        for L in sorted(int(x) for x in context_lens):
            for depth in depths:
                try:
                    prompts, keys = cell_prompts(tokenizer, context_len=L, depth=depth, trials=trials, seed=seed)
                except ValueError as e:
                    warnings.warn(f"passkey: skipping context {L}: {e}", stacklevel=2)
                    continue
                # room for the key plus a little slack for a leading space or punctuation token
                new_tokens = max(len(_encode(tokenizer, " " + k)) for k in keys) + 3
                if limit is not None and L + new_tokens > limit:
                    warnings.warn(f"passkey: skipping context {L}: above max_position_embeddings {limit}", stacklevel=2)
                    continue
                hits = _greedy_hits(model, tokenizer, prompts, keys, new_tokens=new_tokens, batch_size=batch_size,
                                    device=dev)
                rows.append(
                    {"stage": stage, "context_len": L, "depth": float(depth), "accuracy": hits / trials, "n": trials}
                )
    return rows
