"""The held-out text the quality evaluations score: transfer-corpus documents training never saw,
and the token stream they are cut into (perplexity windows, component diagnostic)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hybrid_llama import data


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


def token_stream(tokenizer, texts: Iterable[str]) -> list[int]:
    """Documents tokenized without special tokens and joined as doc EOS doc EOS ..."""
    return token_stream_spans(tokenizer, texts)[0]


def token_stream_spans(tokenizer, texts: Iterable[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """``token_stream`` and each document's ``(start, end)`` in it (its EOS excluded): windows that
    must stay inside one document (a book) are cut within these spans."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for text in texts:
        start = len(ids)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        spans.append((start, len(ids)))
        if eos is not None:
            ids.append(eos)
    return ids, spans
