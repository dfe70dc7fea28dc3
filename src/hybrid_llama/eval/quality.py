"""Quality metrics that can see what linearization costs.

- `perplexity_vs_context`: token NLL on held-out text as a function of context length. Every context
  length above `tail` scores the *same* target tokens (the windows end at the same stream positions, only their
  start moves back), so the curve shows how much each model gains from longer context and nothing else.
- `make_passkey_prompt` / `passkey_accuracy`: synthetic retrieval of a 5-digit key hidden in filler
  text at a chosen depth. The hybrid's softmax window is short, so beyond it the key has to survive in
  the linear state.
- `paired_difference`: MMLU accuracy difference of two result files over the same questions, with a
  paired standard error and a 2-stderr significance rule.
- CSV writers/readers for `perplexity.csv` and `passkey.csv`.
"""

from __future__ import annotations

import csv
import math
import random
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from hybrid_llama import data
from hybrid_llama.runtime import resolve_dtype

PERPLEXITY_COLUMNS = ("stage", "context_len", "nll", "ppl", "n_tokens", "window_nlls")
PASSKEY_COLUMNS = ("stage", "context_len", "depth", "accuracy", "n")


# --------------------------------------------------------------------------- held-out text


def _train_hashes(manifest: dict) -> set[str]:
    """Document hashes a transfer-corpus manifest (hybrid_llama.data) says were packed for training."""
    if manifest.get("split", "all") == "heldout":
        return set()
    if "doc_hashes" not in manifest:
        raise KeyError(f"manifest has no 'doc_hashes' (keys: {sorted(manifest)})")
    return set(manifest["doc_hashes"])


def heldout_texts(
    source: dict | str | Path,
    *,
    n_docs: int | None = None,
    seed: int | None = None,
    exclude_manifest: str | Path | dict | list | None = None,
    heldout_fraction: float | None = None,
) -> list[str]:
    """Held-out documents of the transfer corpus that training never saw, in corpus order.

    `source` is the transfer corpus source spec of `hybrid_llama.data` (`{kind: local, path, text_column}`
    or `{kind: hf, ...}`; a bare path means a local file). Documents are on the held-out side of
    `hybrid_llama.data.split_of(text, heldout_fraction, seed)`, the split the packer uses; the
    fraction and seed default to the ones recorded in `exclude_manifest` (the packed training data's
    manifest). Every document whose sha256 the manifest lists as packed is dropped as well, so even a
    corpus packed with split "all" (fraction 0) yields only documents past its token budget.
    Duplicated texts are kept once. `n_docs`: the first n.
    """
    spec = dict(source) if isinstance(source, dict) else {"kind": "local", "path": str(source)}
    given = exclude_manifest if isinstance(exclude_manifest, (list, tuple)) else [exclude_manifest]
    # the packed .safetensors or its .json; several corpora of one source share fraction and seed
    manifests = [m if isinstance(m, dict) else data.read_manifest(m) for m in given if m is not None]
    manifest = manifests[0] if manifests else None
    train = set().union(*map(_train_hashes, manifests))
    if heldout_fraction is None:
        heldout_fraction = float(manifest.get("heldout_fraction", 0.0)) if manifest else 0.0
    if seed is None:
        seed = int(manifest.get("seed", 0)) if manifest else 0
    if heldout_fraction <= 0 and manifest is None:
        raise ValueError("need heldout_fraction > 0 or a training manifest to know what is held out")
    out, seen = [], set()
    for text, _origin in data.iter_documents(spec):
        h = data.doc_hash(text)
        if not text.strip() or h in train or h in seen:
            continue
        if heldout_fraction > 0 and data.split_of(text, heldout_fraction=heldout_fraction, seed=seed) != "heldout":
            continue
        seen.add(h)
        out.append(text)
        if n_docs is not None and len(out) >= n_docs:
            break
    if not out:
        raise ValueError(
            f"no held-out documents in {spec.get('path', spec)}: pack the transfer corpus with "
            "split='train' and heldout_fraction > 0 (or a token budget that leaves documents unused)"
        )
    return out


# --------------------------------------------------------------------------- perplexity


def _place(model, device, dtype) -> torch.device:
    """Move the model only when asked; otherwise evaluate where it already lives."""
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        model.to(dtype=dtype)
    if device is not None:
        model.to(device)
    return next(model.parameters()).device


def token_stream(tokenizer, texts: Iterable[str]) -> list[int]:
    """Documents tokenized without special tokens and joined as doc EOS doc EOS ..."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return ids


def window_ends(n_stream: int, longest: int, tail: int, max_windows: int | None) -> list[int]:
    """End positions (exclusive) shared by all context lengths; scored tails never overlap.

    Candidates are longest, longest+tail, ... <= n_stream; `max_windows` of them are taken evenly
    spread over the stream so a capped run still samples the whole held-out slice.
    """
    if n_stream < longest:
        return []
    candidates = list(range(longest, n_stream + 1, tail))
    if max_windows is None or max_windows >= len(candidates):
        return candidates
    if max_windows <= 1:
        return candidates[:max_windows]
    step = (len(candidates) - 1) / (max_windows - 1)
    return [candidates[round(i * step)] for i in range(max_windows)]


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, tail: int) -> torch.Tensor:
    """Per-token NLL [B, tail] of the last `tail` tokens of each window [B, L] (fp32)."""
    logits = model(input_ids=windows, logits_to_keep=tail + 1).logits[:, :-1].float()
    targets = windows[:, -tail:]
    logp = torch.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def perplexity_windows(
    n_stream: int, context_lens: Sequence[int], *, tail: int = 64, max_windows: int | None = 32,
    max_len: int | None = None,
) -> dict[int, list[tuple[int, int]]]:
    """{L: [(start, end), ...]} stream slices of exactly L tokens scored by perplexity_vs_context.

    Lengths above `max_len` (the model's positions) or the stream are dropped. All lengths share the
    end positions chosen for the longest one, so they score the same target tokens.
    """
    limit = min(max_len or n_stream, n_stream)
    lens = sorted({int(L) for L in context_lens if 2 <= int(L) <= limit})
    if not lens:
        return {}
    ends = window_ends(n_stream, lens[-1], tail, max_windows)
    return {L: [(e - L, e) for e in ends] for L in lens}


def perplexity_vs_context(
    model,
    tokenizer,
    texts: list[str],
    *,
    context_lens: Sequence[int],
    tail: int = 64,
    device=None,
    dtype=None,
    stage: str,
    max_windows: int | None = 32,
    batch_size: int = 1,
) -> list[dict]:
    """Mean NLL over the last `tail` tokens of windows of exactly L tokens, for each L.

    The held-out `texts` are tokenized and joined with EOS (token_stream); windows come from
    perplexity_windows (at most `max_windows` per length, the same targets at every length).
    Lengths above the model's max_position_embeddings or the stream are skipped. At L <= tail only
    the last L-1 tokens can be scored (a window's first token has no context); n_tokens counts
    the scored tokens. The model is moved only if device/dtype are given.
    Rows: {stage, context_len, nll, ppl, n_tokens, window_nlls (each window's mean NLL)}.
    """
    dev = _place(model, device, dtype)
    stream = token_stream(tokenizer, texts)
    windows = perplexity_windows(len(stream), context_lens, tail=tail, max_windows=max_windows,
                                 max_len=max_positions(model))
    ids = torch.tensor(stream, dtype=torch.long)
    was_training = model.training
    model.eval()
    rows = []
    try:
        for L, spans in windows.items():
            t = min(tail, L - 1)
            per_window: list[float] = []
            for i in range(0, len(spans), batch_size):
                batch = torch.stack([ids[a:b] for a, b in spans[i : i + batch_size]]).to(dev)
                per_window += window_nll(model, batch, t).double().mean(dim=1).tolist()
            mean = sum(per_window) / len(per_window)  # every window scores t tokens
            rows.append({"stage": stage, "context_len": L, "nll": mean, "ppl": math.exp(mean),
                         "n_tokens": t * len(per_window),
                         # windows are the independent units of a paired comparison (paired_nll_difference)
                         "window_nlls": per_window})
    finally:
        model.train(was_training)
    return rows


# --------------------------------------------------------------------------- passkey

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


@torch.no_grad()
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
    prompt parts, are skipped with a warning (no row). All prompts of a cell have the same length, so they batch without
    padding. Rows: {stage, context_len, depth, accuracy, n}.
    """
    dev = _place(model, device, dtype)
    limit = max_positions(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    rows = []
    try:
        for L in sorted(int(x) for x in context_lens):
            for depth in depths:
                prompts, keys = [], []
                try:
                    for trial in range(trials):
                        key = _trial_key(seed, L, depth, trial)
                        ids, _ = make_passkey_prompt(tokenizer, context_len=L, depth=depth, key=key, seed=seed + trial)
                        prompts.append(ids)
                        keys.append(str(key))
                except ValueError as e:
                    warnings.warn(f"passkey: skipping context {L}: {e}", stacklevel=2)
                    continue
                # room for the key plus a little slack for a leading space or punctuation token
                new_tokens = max(len(_encode(tokenizer, " " + k)) for k in keys) + 3
                if limit is not None and L + new_tokens > limit:
                    warnings.warn(f"passkey: skipping context {L}: above max_position_embeddings {limit}", stacklevel=2)
                    continue
                hits = 0
                for i in range(0, trials, batch_size):
                    batch = torch.tensor(prompts[i : i + batch_size], dtype=torch.long, device=dev)
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
                rows.append(
                    {"stage": stage, "context_len": L, "depth": float(depth), "accuracy": hits / trials, "n": trials}
                )
    finally:
        model.train(was_training)
    return rows


def key_found(generated: str, key: str) -> bool:
    """The key counts as retrieved when it appears as a whole number in the continuation
    (so "12345." counts, "123456" does not)."""
    return key in re.findall(r"\d+", generated)


# --------------------------------------------------------------------------- significance


def _per_question(result: dict, metric: str) -> dict[tuple[str, Any], float]:
    """{(subject, doc_id): 0/1} from an eval/mmlu.py result JSON (its `questions` list).

    acc: pred == gold; acc_norm (cloze): pred_norm == gold.
    """
    if "questions" not in result:
        raise KeyError("MMLU result has no per-question 'questions' list (eval/mmlu.py schema hybrid_llama.mmlu/1)")
    field = {"acc": "pred", "acc_norm": "pred_norm"}.get(metric)
    if field is None:
        raise ValueError(f"metric must be 'acc' or 'acc_norm', got {metric!r}")
    out = {}
    for q in result["questions"]:
        if field not in q:
            raise KeyError(f"question {q.get('subject')}/{q.get('doc_id')} has no {field!r} (fmt {result.get('fmt')})")
        out[(q["subject"], q["doc_id"])] = float(q[field] == q["gold"])
    return out


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else float("nan")
    return mean, math.sqrt(var)


def paired_difference(result_a: dict, result_b: dict, *, metric: str = "acc") -> dict:
    """Accuracy of a minus b over the questions both answered, with paired significance.

    stderr_a, stderr_b: sample sd of the per-question 0/1 scores / sqrt(n) (lm-eval's stderr).
    stderr_paired: sd of the per-question differences / sqrt(n). This is the "combined stderr" of
    the rule: the two models answer the same questions, so their errors are correlated and the
    paired stderr is the right (usually smaller) one; stderr_unpaired = sqrt(se_a^2 + se_b^2) is
    given for reference only. significant = |diff| > 2 * stderr_paired.
    """
    a, b = _per_question(result_a, metric), _per_question(result_b, metric)
    settings = {k: (result_a.get(k), result_b.get(k)) for k in ("fmt", "shots") if result_a.get(k) != result_b.get(k)}
    if settings:
        raise ValueError(f"results differ in {settings}: not the same questions/prompts")
    common = sorted(set(a) & set(b), key=repr)
    if not common:
        raise ValueError("the two results share no questions")
    xa = [a[k] for k in common]
    xb = [b[k] for k in common]
    d = [x - y for x, y in zip(xa, xb)]
    n = len(common)
    acc_a, sd_a = _mean_sd(xa)
    acc_b, sd_b = _mean_sd(xb)
    diff, sd_d = _mean_sd(d)
    se_a, se_b, se_d = sd_a / math.sqrt(n), sd_b / math.sqrt(n), sd_d / math.sqrt(n)
    return {
        "metric": metric,
        "n": n,
        "acc_a": acc_a,
        "acc_b": acc_b,
        "diff": diff,
        "stderr_a": se_a,
        "stderr_b": se_b,
        "stderr_paired": se_d,
        "stderr_unpaired": math.sqrt(se_a**2 + se_b**2),
        "n_discordant": sum(1 for x in d if x != 0),  # questions exactly one of the two got right
        "fmt": result_a.get("fmt"),
        "shots": result_a.get("shots"),
        "significant": bool(abs(diff) > 2 * se_d) if not math.isnan(se_d) else False,
    }


# --------------------------------------------------------------------------- CSV


def write_rows(rows: Iterable[dict], path: str | Path, columns: Sequence[str]) -> Path:
    """A CSV of ``rows`` with exactly ``columns`` (the result tables of the quality metrics)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for row in rows:
            # lists (a perplexity row's per-window NLLs) become one space-separated cell
            w.writerow(
                {c: " ".join(f"{x:.6g}" for x in row[c]) if isinstance(row[c], list) else row[c] for c in columns}
            )
    return path


def read_rows(path: str | Path, types: dict[str, type]) -> list[dict]:
    """The rows of a result CSV, each column converted by ``types`` (default str)."""
    with Path(path).open(newline="", encoding="utf-8") as f:
        return [{k: types.get(k, str)(v) for k, v in row.items()} for row in csv.DictReader(f)]


def write_perplexity_csv(rows: Iterable[dict], path: str | Path) -> Path:
    """perplexity.csv: stage,context_len,nll,ppl,n_tokens"""
    return write_rows(rows, path, PERPLEXITY_COLUMNS)


def write_passkey_csv(rows: Iterable[dict], path: str | Path) -> Path:
    """passkey.csv: stage,context_len,depth,accuracy,n"""
    return write_rows(rows, path, PASSKEY_COLUMNS)


def read_perplexity_csv(path: str | Path) -> list[dict]:
    return read_rows(
        path,
        {
            "context_len": int,
            "nll": float,
            "ppl": float,
            "n_tokens": int,
            "window_nlls": lambda text: [float(x) for x in text.split()],
        },
    )


def paired_nll_difference(rows: list[dict], stage_a: str, stage_b: str, context_len: int) -> dict | None:
    """NLL of ``stage_a`` minus ``stage_b`` at ``context_len`` (perplexity rows of both), with the
    standard error of the mean paired difference over windows: both stages score the same tokens of
    the same windows, so the paired error is the honest (and much smaller) one. None if either is
    missing; ``stderr`` is NaN with fewer than two windows."""
    by = {(r["stage"], int(r["context_len"])): r for r in rows}
    a, b = by.get((stage_a, context_len)), by.get((stage_b, context_len))
    if a is None or b is None:
        return None
    wa, wb = a.get("window_nlls") or [], b.get("window_nlls") or []
    diff = float(a["nll"]) - float(b["nll"])
    if len(wa) != len(wb) or len(wa) < 2:
        return {"diff": diff, "stderr": float("nan"), "n_windows": len(wa)}
    mean_d, sd_d = _mean_sd([x - y for x, y in zip(wa, wb)])
    return {"diff": diff, "stderr": sd_d / math.sqrt(len(wa)), "n_windows": len(wa)}


def read_passkey_csv(path: str | Path) -> list[dict]:
    return read_rows(path, {"context_len": int, "depth": float, "accuracy": float, "n": int})
