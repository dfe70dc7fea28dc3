"""Passkey retrieval: a 5-digit key hidden in filler text at a chosen depth, read back greedily.

The hybrid's softmax window is short, so beyond it the key has to survive in the linear state (or in
the sparse cache). Each trial of a length has its own key, filler order and depth, the depths spread
over the context; prompts are built token-exact (``make_passkey_prompt``). A trial is scored
teacher-forced (one forward: would greedy decoding emit the key first?), which equals greedy
generation (tested) at a fraction of its cost; a few trials are also scored by generation. The rows,
one per trial with the needle's distance to the question, go to ``passkey.csv``
(``hybrid_llama.eval.tables``), where the accuracy of the needles beyond the window is aggregated
with its Wilson interval.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Sequence

import torch

from hybrid_llama.eval.placement import cache_keyword, eval_mode, max_positions, output_cache, place_model

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


def spread_depths(trials: int) -> list[float]:
    """One depth per trial, evenly over the filler: (i + 0.5) / trials."""
    return [(i + 0.5) / trials for i in range(trials)]


def needle_trials(
    tokenizer, *, context_len: int, trials: int, seed: int = 0, depths: Sequence[float] | None = None
) -> list[dict]:
    """The trials of one length: each its own key, filler order and depth (``depths``, cycled, or
    spread evenly). A trial: ``prompt`` (ids, ``context_len`` long, ending with the question),
    ``answer`` (the key's tokens as the model should continue), ``key``, ``depth``, ``needle``
    (the positions of the key's first statement) and ``needle_distance`` (tokens from the
    needle's end to the question: beyond the window when larger than it).
    Raises ValueError when the prompt cannot fit."""
    depths = list(depths) if depths else spread_depths(trials)
    question = len(_encode(tokenizer, PASSKEY_QUESTION))
    out = []
    for trial in range(trials):
        depth = float(depths[trial % len(depths)])
        key = _trial_key(seed, context_len, depth, trial)
        ids, (start, end) = make_passkey_prompt(tokenizer, context_len=context_len, depth=depth, key=key,
                                                seed=seed + trial)
        out.append({"trial": trial, "prompt": ids, "answer": passkey_parts(tokenizer, key)["key"], "key": str(key),
                    "depth": depth, "needle": list(range(start, end)), "needle_distance": context_len - question - end})
    return out


# --------------------------------------------------------------------------- scoring


def key_found(generated: str, key: str) -> bool:
    """The key counts as retrieved when it appears as a whole number in the continuation
    (so "12345." counts, "123456" does not)."""
    return key in re.findall(r"\d+", generated)


@torch.no_grad()
def teacher_forced_hit(model, trial: dict, device=None) -> tuple[bool, list[float]]:
    """(hit, needle share per sparse-cache layer) of one trial.

    A hit when greedy decoding would emit exactly the key's tokens first: the prompt runs with a
    cache, the key's tokens are fed after it, and the argmax at every position must be the next key
    token (one forward of prompt + key, split so the cache can be read when the question has been
    asked). The needle share of a hybrid layer with a sparse cache is the fraction of the needle's
    positions held in its cache at that moment, averaged over the KV heads."""
    dev = device or next(model.parameters()).device
    prompt = torch.tensor([trial["prompt"]], device=dev)
    answer = torch.tensor([trial["answer"]], device=dev)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache = output_cache(out)
    shares = needle_in_cache(cache, trial["needle"])
    preds = [out.logits[0, -1].argmax()]
    if answer.shape[1] > 1:
        rest = model(input_ids=answer[:, :-1], **{cache_keyword(model): cache}, use_cache=True).logits
        preds += list(rest[0].argmax(-1))
    return bool(all(int(p) == int(t) for p, t in zip(preds, answer[0]))), shares


def needle_in_cache(cache, needle: Sequence[int]) -> list[float]:
    """Per hybrid layer with a sparse cache (in layer order): the mean over KV heads of the share of
    ``needle`` positions among the cached positions."""
    from hybrid_llama.layers import HybridCacheLayer

    shares = []
    for layer in getattr(cache, "layers", []):
        state = getattr(layer, "state", None) if isinstance(layer, HybridCacheLayer) else None
        if state is None or state.sparse is None or state.sparse.cache_pos.shape[-1] == 0:
            continue
        cached = state.sparse.cache_pos[0]  # [H_kv, λ]
        held = torch.isin(cached, torch.tensor(list(needle), device=cached.device))
        shares.append(float(held.sum(-1).float().mean()) / len(needle))
    return shares


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
    trials: int = 16,
    depths: Sequence[float] | None = None,
    seed: int = 0,
    generate_trials: int = 0,
    device=None,
    stage: str,
    batch_size: int = 1,
    dtype=None,
) -> list[dict]:
    """One row per trial (``tables.PASSKEY_COLUMNS``), scored teacher-forced (``teacher_forced_hit``).

    ``generate_trials``: the first this many trials of the shortest length are also scored by
    greedy generation with the cache (``key_found`` in the continuation), rows with method
    ``generate``: the check that the cheap score reads what generation does. A length up to the
    model's positions whose prompt + answer would not fit takes a prompt shortened by the answer
    (``fitted_length``; the rows keep the nominal length); longer lengths, or lengths too short for
    the fixed prompt parts, are skipped with a warning (no row)."""
    dev = place_model(model, device, dtype)
    limit = max_positions(model)
    new_tokens = len(passkey_parts(tokenizer, 99999)["key"]) + 3  # the key plus slack for punctuation
    rows = []
    with eval_mode(model):
        for i, L in enumerate(sorted(int(x) for x in context_lens)):
            n = fitted_length(L, limit, new_tokens)
            if n is None:
                warnings.warn(f"passkey: skipping context {L}: above max_position_embeddings {limit}", stacklevel=2)
                continue
            try:
                cell = needle_trials(tokenizer, context_len=n, trials=trials, seed=seed, depths=depths)
            except ValueError as e:
                warnings.warn(f"passkey: skipping context {L}: {e}", stacklevel=2)
                continue
            for t in cell:
                hit, shares = teacher_forced_hit(model, t, dev)
                rows.append(_row(stage, L, t, hit, "teacher_forced", shares))
            for t in cell[: generate_trials if i == 0 else 0]:
                hit = _greedy_hits(model, tokenizer, [t["prompt"]], [t["key"]], new_tokens=new_tokens,
                                   batch_size=batch_size, device=dev)
                rows.append(_row(stage, L, t, bool(hit), "generate", []))
    return rows


def fitted_length(context_len: int, limit: int | None, answer_tokens: int) -> int | None:
    """The prompt length that stands for ``context_len``: itself, or, when the prompt and its answer
    would run past the model's ``limit`` positions, shortened by the answer so both fit (a prompt of
    8184 tokens stands for 8192 in a model of 8192 positions). None when ``context_len`` exceeds
    ``limit`` itself."""
    if limit is None or context_len + answer_tokens <= limit:
        return context_len
    return limit - answer_tokens if context_len <= limit else None


def _row(stage: str, L: int, trial: dict, hit: bool, method: str, shares: list[float]) -> dict:
    return {"stage": stage, "context_len": L, "trial": trial["trial"], "depth": round(trial["depth"], 6),
            "key": trial["key"], "needle_distance": trial["needle_distance"], "method": method,
            "accuracy": float(hit), "n": 1,
            "needle_in_cache": round(sum(shares) / len(shares), 6) if shares else "",
            "needle_in_cache_layers": " ".join(f"{x:.3f}" for x in shares)}
