"""Is a long window's NLL gap the length or the positions? The same targets, scored by windows of
each length at each start position.

    export PYTHONPATH=src
    nice -n 5 .venv/bin/python benchmarks/probe_positions.py --models \\
        base=resources/weights/smollm2,hybrid=results/smollm2/lolcats_retrieval/model --out results/probe_positions

Softmax attention is relative in position: base scores a window the same wherever it starts. A
hybrid layer's feature maps read q and k after RoPE, so a hybrid scores it differently at positions
its training rows seldom held. The windows are the books evaluation's (the held-out books, each
window inside one book, ``--windows`` of them, the last ``--tail`` tokens scored: the same targets at
every length); each length L runs from position 0 and from ``--max-position - L`` (its last tokens at
the model's last positions), so "length" compares windows at one start and "position" one window
at two starts. Writes ``positions.json``; with ``--shares``, also each hybrid layer's window / cache /
linear shares of the normalizer at each length (``eval.components.window_shares``, the component
diagnostic, on the same books' stream) in ``shares.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybrid_llama.books import heldout_books
from hybrid_llama.eval.components import window_shares
from hybrid_llama.eval.heldout import token_stream_spans
from hybrid_llama.eval.perplexity import perplexity_windows, window_nll


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="name=directory,... (exported or base weights)")
    ap.add_argument("--books-dir", default="../shared/data/gutenberg")
    ap.add_argument("--books", default="pg174,pg1342", help="held-out books (data.books.heldout)")
    ap.add_argument("--lengths", default="2048,4096,6144,8192")
    ap.add_argument("--max-position", type=int, default=8192)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shares", action="store_true", help="also the component diagnostic at each length")
    ap.add_argument("--out", default="results/probe_positions")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hybrid_llama  # noqa: F401  (registers the exported model type)

    models = dict(item.split("=", 1) for item in args.models.split(","))
    lengths = [int(x) for x in args.lengths.split(",")]
    rows, shares = [], []
    for name, directory in models.items():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype)).eval()
        tok = AutoTokenizer.from_pretrained(directory)
        texts = heldout_books(args.books_dir, args.books.split(","))
        ids, books = token_stream_spans(tok, texts)
        stream = torch.tensor(ids)
        windows = perplexity_windows(len(stream), lengths, tail=args.tail, max_windows=args.windows,
                                     max_len=args.max_position, documents=books)
        for L, spans in windows.items():
            for start in sorted({0, args.max_position - L}):
                t = time.time()
                nll = [float(window_nll(model, stream[a:b][None], args.tail, start).mean()) for a, b in spans]
                rows.append({"model": name, "length": L, "start": start, "nll": nll})
                print(f"{name} L={L} start={start} nll={[round(x, 4) for x in nll]} ({time.time() - t:.0f} s)",
                      flush=True)
        if args.shares:
            for r in window_shares(model, tok, texts, context_lens=lengths, tail=args.tail, max_windows=args.windows,
                                   stage=name):
                shares.append(r)
                print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "positions.json").write_text(json.dumps(rows, indent=1))
    if args.shares:
        (out / "shares.json").write_text(json.dumps(shares, indent=1))


if __name__ == "__main__":
    main()
