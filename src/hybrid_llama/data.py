"""Training data: the packed transfer corpus and the instruction-tuning set.

Both builders read a *source spec* (a dict from config; ``hybrid_llama.sources`` reads it), tokenize
with the model's tokenizer and write one safetensors file plus a JSON manifest beside it (same name,
``.json``). Config keys and defaults are listed in each function's docstring (and, as workflow
config, in ``config/schema.yaml``). Bad data raises :class:`DataError` naming the file and the line
or row.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .books import book_names, read_books, split_books
from .files import atomic_write, load_safetensors, save_safetensors, sha256_of

# The readers live in .sources; these names stay importable from here for existing callers.
from .sources import (
    DataError,
    column_text,
    doc_hash,
    iter_documents,
    iter_rows,
    source_files,
    split_documents,
    split_of,
)

__all__ = [
    "DataError",
    "doc_hash",
    "split_of",
    "split_documents",
    "iter_documents",
    "iter_rows",
    "prepare_transfer_corpus",
    "mix_rows",
    "prepare_book_rows",
    "book_row_plan",
    "load_packed",
    "read_manifest",
    "prepare_instruct_data",
    "load_instruct",
    "format_instruction",
]

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------- helpers


def _load_tokenizer(tokenizer: Any):
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        if not Path(tokenizer).is_dir():  # else transformers treats it as a Hub id and fails obscurely
            raise FileNotFoundError(f"tokenizer directory {tokenizer} does not exist")
        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _tokenizer_name(tok) -> str:
    return str(getattr(tok, "name_or_path", "") or type(tok).__name__)


def _manifest_path(out_path: str | os.PathLike) -> Path:
    p = Path(out_path)
    return p.with_suffix(".json") if p.suffix == ".safetensors" else Path(str(p) + ".json")


def _write_outputs(out_path: Path, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    """The tensors and their manifest beside them, each written atomically."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(out_path, tensors, metadata={"manifest": _manifest_path(out_path).name})
    atomic_write(_manifest_path(out_path), json.dumps(manifest, indent=1) + "\n")


def read_manifest(path: str | os.PathLike) -> dict:
    """Manifest of a file written by this module (pass the safetensors path or the .json itself)."""
    p = Path(path)
    return json.loads((p if p.suffix == ".json" else _manifest_path(p)).read_text())


def _check_keys(given: dict, allowed: dict, what: str) -> dict:
    unknown = set(given) - set(allowed)
    if unknown:
        raise ValueError(f"{what}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
    return {**allowed, **given}


# ---------------------------------------------------------------------------------- transfer corpus

CORPUS_DEFAULTS: dict[str, Any] = {
    "seq_len": 1024,
    "num_tokens": 1_000_000,
    "split": "all",
    "heldout_fraction": 0.0,
    "seed": 0,
    "add_bos": False,
}


def prepare_transfer_corpus(source: dict, tokenizer: Any, out_path: str | os.PathLike, **corpus: Any) -> dict:
    """Tokenize, concatenate with EOS and pack documents into ``[N, seq_len]`` rows; returns the manifest.

    Keys (defaults): seq_len 1024; num_tokens 1_000_000 (``None`` = everything; output has
    ``num_tokens // seq_len`` rows, fewer available tokens raise DataError); split "all" | "train" |
    "heldout"; heldout_fraction 0.0; seed 0 (hash split); add_bos False.
    Writes ``out_path`` (safetensors ``tokens`` int32) and the JSON manifest beside it.
    Documents are read in source order and reading stops once the budget is met, so a streamed HF
    source is only read as far as needed.
    """
    cfg = _check_keys(corpus, CORPUS_DEFAULTS, "transfer corpus")
    L, budget, split = int(cfg["seq_len"]), cfg["num_tokens"], cfg["split"]
    if split not in ("all", "train", "heldout"):
        raise ValueError(f"split must be all|train|heldout, got {split!r}")
    if split != "all" and cfg["heldout_fraction"] <= 0:
        raise ValueError(f"split={split!r} needs heldout_fraction > 0")
    if budget is not None and budget < L:
        raise ValueError(f"num_tokens={budget} is less than one sequence of seq_len={L}")
    tok = _load_tokenizer(tokenizer)
    eos = tok.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {_tokenizer_name(tok)} has no EOS token to separate documents")
    bos = [tok.bos_token_id] if cfg["add_bos"] and tok.bos_token_id is not None else []

    need = None if budget is None else (budget // L) * L
    ids: list[int] = []
    hashes: list[str] = []
    stream = hashlib.sha256()
    empty_source = True
    for text, _origin in iter_documents(source):
        empty_source = False
        if split != "all" and split_of(text, heldout_fraction=cfg["heldout_fraction"], seed=cfg["seed"]) != split:
            continue
        if not text.strip():
            continue
        ids.extend(bos + tok(text, add_special_tokens=False)["input_ids"] + [eos])
        hashes.append(doc_hash(text))
        stream.update(text.encode("utf-8") + b"\0")
        if need is not None and len(ids) >= need:
            break
    label = source.get("path", source)
    if empty_source:
        raise DataError(f"{label}: no documents")
    if need is not None and len(ids) < need:
        raise DataError(
            f"{label}: only {len(ids)} tokens in {len(hashes)} documents (split={split}), "
            f"fewer than the {need} asked for ({need // L} x {L})"
        )
    n = len(ids) // L if need is None else need // L
    if n == 0:
        raise DataError(f"{label}: only {len(ids)} tokens, fewer than one sequence of {L}")
    tokens = torch.tensor(ids[: n * L], dtype=torch.int32).view(n, L)
    manifest = {
        "kind": "transfer_corpus",
        "source": dict(source),
        "split": split,
        "heldout_fraction": cfg["heldout_fraction"],
        "seed": cfg["seed"],
        "seq_len": L,
        "num_tokens_requested": budget,
        "token_count": n * L,
        "num_sequences": n,
        "num_documents": len(hashes),
        "tokenizer": _tokenizer_name(tok),
        "eos_token_id": eos,
        "add_bos": bool(bos),
        "files": [{"path": str(p), "sha256": sha256_of(p)} for p in source_files(source)],
        "inputs_sha256": stream.hexdigest(),
        "doc_hash": "sha256(utf-8 text)",
        "doc_hashes": hashes,
    }
    _write_outputs(Path(out_path), {"tokens": tokens}, manifest)
    return manifest


def book_row_plan(slots: list[int], rows: int | None) -> list[list[int]]:
    """Which of each book's ``slots`` (its non-overlapping row positions) to cut: ``rows`` rows in all
    (None = every slot), shared out in proportion to the books' slots (largest remainder, ties to the
    earlier book) and spread evenly inside each book, so the rows sample every part of every book."""
    total = sum(slots)
    if rows is None or rows >= total:
        if rows is not None and rows > total:
            raise ValueError(f"{rows} rows asked for, the books hold {total}")
        return [list(range(n)) for n in slots]
    exact = [rows * n / total for n in slots]
    share = [int(x) for x in exact]
    by_remainder = sorted(range(len(slots)), key=lambda i: (-(exact[i] - share[i]), i))
    for i in by_remainder[: rows - sum(share)]:
        share[i] += 1
    return [[int((j + 0.5) * n / a) for j in range(a)] for n, a in zip(slots, share)]


def prepare_book_rows(books: dict, tokenizer: Any, out_path: str | os.PathLike, *, seq_len: int,
                      num_tokens: int | None) -> dict:
    """Rows of ``seq_len`` consecutive tokens cut from the training books (``books``: ``{dir,
    heldout}``, as ``hybrid_llama.books``: every book of the directory not held out), for training on
    text whose context runs the whole row; returns the manifest.

    ``num_tokens // seq_len`` rows (None = every non-overlapping row of every book) are placed by
    ``book_row_plan`` and ordered by how far through its book each lies, so the last rows (a stage's
    validation rows) come from several books. No row crosses a book's end and no EOS is inserted. Writes ``out_path``
    (safetensors ``tokens`` int32 ``[N, seq_len]``) and the JSON manifest beside it, which records
    each row's book and token offset."""
    L = int(seq_len)
    if num_tokens is not None and num_tokens < L:
        raise ValueError(f"num_tokens={num_tokens} is less than one row of seq_len={L}")
    directory = Path(books["dir"])
    names = split_books(book_names(directory), list(books["heldout"]))["train"]
    if not names:
        raise DataError(f"{directory}: every book is held out (data.books.heldout); none is left to train on")
    tok = _load_tokenizer(tokenizer)
    texts = read_books(directory, names)
    ids = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    slots = [len(x) // L for x in ids]
    want = None if num_tokens is None else num_tokens // L
    if want is not None and want > sum(slots):
        raise DataError(f"{directory}: the training books {names} hold {sum(slots)} rows of {L} tokens, "
                        f"fewer than the {want} asked for (num_tokens={num_tokens})")
    if sum(slots) == 0:
        raise DataError(f"{directory}: no training book {names} holds one row of {L} tokens")
    plan = book_row_plan(slots, want)
    # by how far through its book a row lies, so that every part of the list mixes the books
    order = sorted(((j, b, slot) for b, picked in enumerate(plan) for j, slot in enumerate(picked)),
                   key=lambda r: ((r[0] + 0.5) / len(plan[r[1]]), r[1]))
    tokens = torch.tensor([ids[b][slot * L:(slot + 1) * L] for _, b, slot in order], dtype=torch.int32)
    manifest = {
        "kind": "book_rows",
        "source": {"dir": str(directory), "heldout": sorted(books["heldout"])},
        "seq_len": L,
        "num_tokens_requested": num_tokens,
        "token_count": tokens.numel(),
        "num_sequences": len(order),
        "books": [{"name": n, "tokens": len(x), "rows": len(p), "sha256": sha256_of(directory / f"{n}.txt")}
                  for n, x, p in zip(names, ids, plan)],
        "rows": [{"book": names[b], "offset": slot * L} for _, b, slot in order],
        "tokenizer": _tokenizer_name(tok),
        "doc_hash": "sha256(utf-8 text, boilerplate cut)",
        "doc_hashes": [doc_hash(t) for t in texts],
    }
    _write_outputs(Path(out_path), {"tokens": tokens}, manifest)
    return manifest


def mix_rows(parts: list[str | os.PathLike], out_path: str | os.PathLike) -> dict:
    """Interleave the rows of packed files (``load_packed``, equal row lengths) into one, each part's
    rows spread evenly over the result, so that every stretch of rows, the last ones (a stage's
    validation rows) included, holds each part; returns the manifest, which names each part's
    manifest and the part and row of every row."""
    loaded = [load_packed(p) for p in parts]
    lengths = {t.shape[1] for t in loaded}
    if len(lengths) != 1:
        raise DataError(f"rows of different lengths {sorted(lengths)} cannot be mixed: {[str(p) for p in parts]}")
    order = sorted(((k, i) for k, t in enumerate(loaded) for i in range(len(t))),
                   key=lambda r: ((r[1] + 0.5) / len(loaded[r[0]]), r[0]))
    tokens = torch.stack([loaded[k][i] for k, i in order]).to(torch.int32)
    manifest = {
        "kind": "mixed_rows",
        "seq_len": lengths.pop(),
        "token_count": tokens.numel(),
        "num_sequences": len(order),
        "parts": [{"manifest": str(_manifest_path(p)), "kind": read_manifest(p)["kind"], "rows": len(t)}
                  for p, t in zip(parts, loaded)],
        "row_parts": [[k, i] for k, i in order],
    }
    _write_outputs(Path(out_path), {"tokens": tokens}, manifest)
    return manifest


def load_packed(path: str | os.PathLike) -> torch.Tensor:
    """Packed token rows as int64 ``[N, L]``."""
    t = load_safetensors(path, rule="transfer_data or instruct_data")
    if "tokens" not in t:
        raise DataError(f"{path}: no 'tokens' tensor (keys {sorted(t)})")
    return t["tokens"].long()


# -------------------------------------------------------------------------------- instruction data

INSTRUCT_DEFAULTS: dict[str, Any] = {
    "max_length": 512,
    "val_fraction": 0.05,
    "seed": 0,
    "max_examples": None,
    "template": "auto",
}

PLAIN_TEMPLATE = "### Instruction:\n{instruction}\n\n{context_block}### Response:\n"


def format_instruction(tok: Any, instruction: str, context: str, response: str, template: str) -> tuple[str, str]:
    """Return (prompt_text, completion_text); training sees prompt + completion, loss on completion only."""
    user = instruction if not context.strip() else f"{instruction}\n\n{context}"
    if template == "chat":
        msgs = [{"role": "user", "content": user}]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": response}], tokenize=False)
        if not full.startswith(prompt):
            # Some templates rewrite earlier turns; then the prompt boundary is ambiguous.
            raise DataError(f"chat template of {_tokenizer_name(tok)} does not extend the prompt; use template=plain")
        return prompt, full[len(prompt) :]
    ctx = f"### Context:\n{context}\n\n" if context.strip() else ""
    prompt = PLAIN_TEMPLATE.format(instruction=instruction, context_block=ctx)
    return prompt, response + (tok.eos_token or "")


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return out


def prepare_instruct_data(source: dict, tokenizer: Any, out_path: str | os.PathLike, **instruct: Any) -> dict:
    """Format instruction rows, mask prompt tokens with -100 in labels, split train/val; returns manifest.

    Keys (defaults): max_length 512; val_fraction 0.05 (at least one example); seed 0 (permutation);
    max_examples None; template "auto" (chat template when the tokenizer has one, else plain) | "chat" | "plain".
    Columns: ``instruction``, ``response`` (required), ``context`` (optional). Output tensors
    ``{train,val}.{input_ids,labels,attention_mask}`` int32, right-padded (pad = pad_token_id or EOS,
    labels -100 there).
    """
    cfg = _check_keys(instruct, INSTRUCT_DEFAULTS, "instruction data")
    tok = _load_tokenizer(tokenizer)
    template = cfg["template"]
    if template == "auto":
        template = "chat" if getattr(tok, "chat_template", None) else "plain"
    if template not in ("chat", "plain"):
        raise ValueError(f"template must be auto|chat|plain, got {template!r}")
    max_len = int(cfg["max_length"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    examples: list[tuple[list[int], list[int]]] = []
    stream = hashlib.sha256()
    dropped = truncated = rows = 0
    for row, origin in iter_rows(source):
        if cfg["max_examples"] is not None and rows >= cfg["max_examples"]:
            break
        rows += 1
        instr = column_text(row, "instruction", origin)
        resp = column_text(row, "response", origin)
        ctx = column_text(row, "context", origin, required=False)
        stream.update(json.dumps([instr, ctx, resp]).encode() + b"\0")
        prompt, completion = format_instruction(tok, instr, ctx, resp, template)
        # Tokenize the two parts separately so the mask boundary is exact (no merge across it).
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"]
        if len(p_ids) >= max_len:
            dropped += 1
            continue
        ids = (p_ids + c_ids)[:max_len]
        truncated += len(p_ids) + len(c_ids) > max_len
        examples.append((ids, [IGNORE_INDEX] * len(p_ids) + ids[len(p_ids) :]))
    label = source.get("path", source)
    if rows == 0:
        raise DataError(f"{label}: no rows")
    if len(examples) < 2:
        raise DataError(
            f"{label}: {len(examples)} usable examples (dropped {dropped} over max_length={max_len}); need 2"
        )

    g = torch.Generator().manual_seed(int(cfg["seed"]))
    perm = torch.randperm(len(examples), generator=g).tolist()
    n_val = min(len(examples) - 1, max(1, round(cfg["val_fraction"] * len(examples))))
    # Keep each split in source order: only membership is random.
    parts = {"val": sorted(perm[:n_val]), "train": sorted(perm[n_val:])}
    tensors: dict[str, torch.Tensor] = {}
    counts = {}
    for split, idx in parts.items():
        ids = [examples[i][0] for i in idx]
        labs = [examples[i][1] for i in idx]
        tensors[f"{split}.input_ids"] = _pad(ids, pad_id)
        tensors[f"{split}.labels"] = _pad(labs, IGNORE_INDEX)
        tensors[f"{split}.attention_mask"] = _pad([[1] * len(r) for r in ids], 0)
        counts[split] = int((tensors[f"{split}.labels"] != IGNORE_INDEX).sum())
    manifest = {
        "kind": "instruct",
        "source": dict(source),
        "files": [{"path": str(p), "sha256": sha256_of(p)} for p in source_files(source)],
        "inputs_sha256": stream.hexdigest(),
        "tokenizer": _tokenizer_name(tok),
        "template": template,
        "max_length": max_len,
        "seed": cfg["seed"],
        "val_fraction": cfg["val_fraction"],
        "num_rows": rows,
        "num_train": len(parts["train"]),
        "num_val": len(parts["val"]),
        "num_dropped": dropped,
        "num_truncated": int(truncated),
        "train_label_tokens": counts["train"],
        "val_label_tokens": counts["val"],
        "pad_token_id": pad_id,
    }
    _write_outputs(Path(out_path), tensors, manifest)
    return manifest


def load_instruct(path: str | os.PathLike, split: str = "train") -> dict[str, torch.Tensor]:
    """``{input_ids, labels, attention_mask}`` (int64, right-padded) of one split ("train" | "val")."""
    t = load_safetensors(path, rule="transfer_data or instruct_data")
    keys = ("input_ids", "labels", "attention_mask")
    missing = [k for k in keys if f"{split}.{k}" not in t]
    if missing:
        raise DataError(f"{path}: no split {split!r} (missing {missing})")
    return {k: t[f"{split}.{k}"].long() for k in keys}


def main(argv: list[str] | None = None) -> None:
    """``python -m hybrid_llama.data {corpus|instruct} --source JSON --tokenizer DIR --out PATH [--config JSON]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hybrid_llama.data", description="Prepare training data.")
    ap.add_argument("what", choices=["corpus", "instruct"])
    ap.add_argument("--source", required=True, help='source spec as JSON, e.g. {"kind": "local", "path": "x.jsonl"}')
    ap.add_argument("--tokenizer", required=True, help="model directory holding the tokenizer")
    ap.add_argument("--out", required=True, help="output .safetensors (manifest goes beside it as .json)")
    ap.add_argument("--config", default="{}", help="JSON dict of keys (see the function docstrings)")
    a = ap.parse_args(argv)
    fn = prepare_transfer_corpus if a.what == "corpus" else prepare_instruct_data
    m = fn(json.loads(a.source), a.tokenizer, a.out, **json.loads(a.config))
    print(json.dumps({k: v for k, v in m.items() if k != "doc_hashes"}, indent=1))


if __name__ == "__main__":
    main()
