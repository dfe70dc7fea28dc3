"""Probe: does bounding the linear state's weight help a sparse-cache hybrid past its training length?

Evaluation only, on an exported model with a sparse cache (``lolcats_sparse_distill``): the linear
part's mixing weight ``b`` is scaled, per query group, by ``min(1, n0 / n)`` where ``n`` is the number
of keys already folded into the linear state and ``n0`` the number a training row ends with. With the
shared normalizer this keeps the linear part's share of the output near what training calibrated,
however many keys it holds (docs/long-context.md, "count"). Nothing is trained, so this only says
whether a trained version is worth building into every backend.

The scaling goes into the native sparse prefill (``hybrid_sparse_group_f32``: its per-head ``wb`` is
rewritten before each group of queries) and, for the few answer tokens a teacher-forced passkey trial
feeds after the prompt, into the torch paths' ``mixing_weights``. The script fails if a prompt did
not take the native path, so the probe cannot silently measure the unscaled model.

    python benchmarks/probe_sparse_count.py results/smollm2/lolcats_sparse_distill/model \
        --n0 1852 --passkey 4096,8192 --books 4096,8192
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch

import hybrid_llama  # noqa: F401  (registers the model type)
from hybrid_llama.books import heldout_books
from hybrid_llama.eval import passkey as passkey_eval
from hybrid_llama.eval.perplexity import perplexity_vs_context
from hybrid_llama.ops.hybrid import reference
from hybrid_llama.ops.native import build, sparse_prefill
from hybrid_llama.ops.native.bindings import Kernel
from hybrid_llama.ops.sparse import batched, chunked, step


class Scaling:
    """The linear weight's factor: per group in the native prefill, one value for torch-path calls."""

    def __init__(self, n0: int, window: int, sinks: int, cache: int) -> None:
        self.n0, self.window, self.sinks, self.cache = n0, window, sinks, cache
        self.torch_factor = 1.0
        self.native_groups = 0

    def factor(self, n_linear: int) -> float:
        return 1.0 if self.n0 <= 0 or n_linear <= self.n0 else self.n0 / n_linear

    def linear_keys(self, position: int) -> int:
        """Keys folded into the linear state when the query at ``position`` runs (blocks closed)."""
        return max(0, position - self.window - self.sinks - self.cache)


def install(scaling: Scaling) -> None:
    lib = build.load()
    params = Kernel("hybrid_sparse_group_f32").params
    at = {name: params.index(name) for name in ("H", "t0", "wb")}
    originals: dict[int, list[float]] = {}

    class Lib:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            if name != "hybrid_sparse_group_f32":
                return fn

            def group(*args):
                H, t0, ptr = args[at["H"]], int(args[at["t0"]]), args[at["wb"]]
                wb = (ctypes.c_float * H).from_address(ptr)
                if t0 == 0 or ptr not in originals:  # a new op call: its wb as the layer set it
                    originals[ptr] = list(wb)
                c = scaling.factor(scaling.linear_keys(t0))
                for h in range(H):
                    wb[h] = originals[ptr][h] * c
                scaling.native_groups += 1
                return fn(*args)

            return group

    sparse_prefill.build.load = lambda: Lib()

    def scaled_mixing(window_logit, linear_logit):
        a, b = reference.mixing_weights(window_logit, linear_logit)
        return a, b * scaling.torch_factor

    for module in (chunked, step, batched):
        module.mixing_weights = scaled_mixing


def teacher_forced_hit(scaling: Scaling):
    """passkey.teacher_forced_hit with the answer tokens' factor set from the prompt's length."""
    original = passkey_eval.teacher_forced_hit

    def hit(model, trial, device=None):
        before = scaling.native_groups
        # the prompt runs natively (checked below); the answer's few tokens run the torch path
        scaling.torch_factor = scaling.factor(scaling.linear_keys(len(trial["prompt"])))
        try:
            result = original(model, trial, device)
        finally:
            scaling.torch_factor = 1.0
        if scaling.native_groups == before:
            raise RuntimeError("the prompt did not take the native sparse prefill: the probe would not scale it")
        return result

    return hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--n0", type=int, default=1852, help="linear keys at the end of a training row (0 = off)")
    ap.add_argument("--passkey", default="4096,8192")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--books", default="4096,8192")
    ap.add_argument("--books-dir", default="../shared/data/gutenberg")
    ap.add_argument("--heldout", default="pg174,pg1342")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="as the default run's evaluations on a bf16-native CPU")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    hc = model.config.hybrid
    hc = hc if isinstance(hc, dict) else vars(hc)
    scaling = Scaling(args.n0, hc["window"], hc.get("sinks", 0), hc.get("sparse_cache", 0))
    install(scaling)
    passkey_eval.teacher_forced_hit = teacher_forced_hit(scaling)

    out: dict = {"n0": args.n0}
    if args.books:
        rows = perplexity_vs_context(model, tok, heldout_books(args.books_dir, args.heldout.split(",")),
                                     context_lens=[int(x) for x in args.books.split(",")], tail=256,
                                     max_windows=2, within_documents=True, stage="probe")
        out["books"] = {r["context_len"]: r["window_nlls"] for r in rows}
    if args.passkey:
        rows = passkey_eval.passkey_accuracy(model, tok, context_lens=[int(x) for x in args.passkey.split(",")],
                                             trials=args.trials, stage="probe")
        out["passkey"] = {}
        for r in rows:
            out["passkey"].setdefault(r["context_len"], []).append(int(r["accuracy"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
