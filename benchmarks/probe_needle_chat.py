"""Probe: the multi-key needle test with its prompt in the instruct model's chat format.

Evaluation only. The pipeline's needle test (``hybrid_llama.eval.niah``) hands the model raw text:
[BOS] intro, a held-out book with the needles, then the question and the answer's start. RULER
wraps an instruct model's prompt in that model's chat template instead. This probe asks the same
trials both ways: ``raw`` is the pipeline's prompt token for token; ``chat`` puts the intro, the
haystack and the question into one user turn, opens the assistant's turn and starts it with "The
special magic number for KEY is", so both ways the model continues the same words. The chat
prompts are a few dozen tokens longer. Scored as the pipeline scores (greedy generation with the
cache, ``score_answer``).

    python benchmarks/probe_needle_chat.py resources/weights/smollm2 results/smollm2/lolcats_retrieval/model
"""

from __future__ import annotations

import argparse
import json

import torch

import hybrid_llama  # noqa: F401  (registers the model type)
from hybrid_llama.books import heldout_books
from hybrid_llama.eval.niah import (
    answer_tokens,
    book_haystack,
    generate_answer,
    niah_trials,
    question_text,
    score_answer,
)
from hybrid_llama.eval.passkey import _encode
from hybrid_llama.eval.placement import eval_mode
from hybrid_llama.models.io import load_model


def chat_prompt(tokenizer, trial: dict) -> list[int]:
    """``trial``'s prompt as one user turn of ``tokenizer``'s chat template, the answer begun."""
    question = _encode(tokenizer, question_text(trial["key"]))
    body = tokenizer.decode(trial["prompt"][: -len(question)], skip_special_tokens=True).strip()
    turn = [{"role": "user", "content": f"{body}\nWhat is the special magic number for {trial['key']}?"}]
    text = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    text += f"The special magic number for {trial['key']} is"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model directories (base or exported hybrids)")
    ap.add_argument("--formats", default="raw,chat")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--keys", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--books", default="../shared/data/gutenberg")
    ap.add_argument("--heldout", default="pg174,pg1342")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    books = heldout_books(args.books, args.heldout.split(","))
    for directory in args.models:
        model, tokenizer = load_model(directory, dtype=args.dtype)
        trials = niah_trials(tokenizer, context_len=args.context, trials=args.trials, n_keys=args.keys,
                             haystack="book", seed=args.seed, book_ids=book_haystack(tokenizer, books))
        new_tokens = answer_tokens(tokenizer)
        for fmt in args.formats.split(","):
            rows = []
            with eval_mode(model), torch.no_grad():
                for t in trials:
                    ids = t["prompt"] if fmt == "raw" else chat_prompt(tokenizer, t)
                    answer = generate_answer(model, tokenizer, ids, new_tokens, torch.device("cpu"))
                    found, answered = score_answer(answer, t)
                    rows.append({"needle_distance": t["needle_distance"], "found": found,
                                 "answered_key": answered, "answer": answer.strip()[:20]})
            print(json.dumps({"model": directory, "format": fmt, "found": sum(r["found"] for r in rows),
                              "trials": len(rows), "prompt_tokens": len(ids), "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
