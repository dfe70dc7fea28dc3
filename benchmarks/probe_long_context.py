"""Why a linearized hybrid breaks past its training length, and arms that need no retraining.

    export PYTHONPATH=src
    # NLL of the last 256 tokens at 2048/4096/8192 on two held-out books, every arm on the same targets
    nice -n 5 .venv/bin/python benchmarks/probe_long_context.py nll --out results/probe_long_context \
        --arms base,lolcats,window_only,linear_off,decay:0.999,sparse:128:4
    # normalizer shares, the two sums, the linear kernel against softmax, feature statistics
    nice -n 5 .venv/bin/python benchmarks/probe_long_context.py diagnose --out results/probe_long_context
    # the probe's own op against the project's (it must agree before its arms mean anything)
    .venv/bin/python benchmarks/probe_long_context.py check

The trained variant comes from a default run's artifacts (``results/<model>/<variant>/transfer`` and
``lora``: ``snakemake --cores 2 results/smollm2/lolcats/lora/adapter_model.safetensors``). Books are
``../shared/data/gutenberg/pg<N>.txt`` (their Gutenberg header is already cut there); windows of each
length end at the same stream positions, so every length and arm scores the same target tokens.

Arms (``--arms``, comma separated):
- ``base``, ``lolcats`` (the trained variant through the project's op), ``window_only`` (the same
  layers converted untrained with the window alone: the pipeline's control), ``linear_off`` (the
  trained variant with its linear part switched off);
- ``probe``: the trained variant through this script's op, unchanged (must equal ``lolcats``);
- ``decay:G``: the linear state decays by G per token once a key has left the window;
- ``linwin:N``: the linear part reads only keys fewer than N positions back (a multiple of the window);
- ``count:N``: past N tokens the linear part's weight is scaled by (N - w) / (keys in the linear part),
  so its sums keep the size they had at the training length;
- ``wrap:N``: the feature maps read q and k at RoPE positions ``t mod N`` (angles of the training rows);
  arms of the probe's op combine with '+', e.g. ``wrap:2048+decay:0.999``;
- ``sparse:S:K``: the project's sparse cache with S keys per KV head and K sinks on the trained layers;
- ``shift`` / ``base_shift``: positions offset so that every window ends at the model's last
  position (8191): the same tokens and key counts, only the absolute RoPE rotations change.
The probe's op is blockwise with block = window (O(T w D + T F D)), fp32, and exists only here.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from long_context_op import probe_attention  # this folder (the script's own modules)
from long_context_stats import Collector, report_diagnosis

import hybrid_llama.ops.dispatch as dispatch
from hybrid_llama.layers import HybridConfig, HybridLlamaAttention
from hybrid_llama.ops.feature_maps import resolve_qk_maps
from hybrid_llama.stages import load_stage

PROJECT_OP = dispatch.hybrid_attention  # what a hybrid layer's prompt calls (ops.layer_prompt)


@dataclass(frozen=True)
class Arm:
    """How the trained hybrid layers compute their attention in one arm."""

    name: str
    model: str = "lolcats"  # base | lolcats | window_only
    op: str = "project"  # project | probe
    gamma: float = 1.0
    lin_window: int = 0
    count_ref: int = 0
    formulation: str | None = None
    sparse_cache: int = 0
    sinks: int = 0
    shift: bool = False
    wrap: int = 0


def parse_arm(spec: str) -> Arm:
    """One arm, or several probe-op changes joined by '+' (``wrap:2048+decay:0.999``)."""
    if "+" in spec:
        parts = [parse_arm(p) for p in spec.split("+")]
        changed = {f: getattr(p, f) for p in parts for f in ("gamma", "lin_window", "count_ref", "wrap")
                   if getattr(p, f) != getattr(Arm(""), f)}
        return Arm(spec, op="probe", **changed)
    kind, *args = spec.split(":")
    simple = {
        "base": Arm(spec, model="base"), "base_shift": Arm(spec, model="base", shift=True),
        "lolcats": Arm(spec), "shift": Arm(spec, shift=True), "probe": Arm(spec, op="probe"),
        "window_only": Arm(spec, model="window_only"), "linear_off": Arm(spec, formulation="window"),
    }
    if kind in simple and not args:
        return simple[kind]
    if kind == "decay":
        return Arm(spec, op="probe", gamma=float(args[0]))
    if kind == "linwin":
        return Arm(spec, op="probe", lin_window=int(args[0]))
    if kind == "wrap":
        return Arm(spec, op="probe", wrap=int(args[0]))
    if kind == "count":
        return Arm(spec, op="probe", count_ref=int(args[0]))
    if kind == "sparse":
        return Arm(spec, sparse_cache=int(args[0]), sinks=int(args[1]))
    raise SystemExit(f"unknown arm {spec!r}")


# ---------------------------------------------------------------------------------------------------
# Models, arms and the layer patch.


class Probe:
    """The models of one run and the switch that routes their hybrid layers through an arm."""

    def __init__(self, args):
        self.args = args
        self.arm: Arm | None = None
        self.layer = None  # the hybrid layer running now (set by a pre-hook)
        self.on_layer = None  # diagnose: called with (layer, q, k, v, stats)
        self.models: dict[str, torch.nn.Module] = {}
        cfg = yaml.safe_load(Path(args.config).read_text())
        variant = next(v for v in cfg["variants"] if v["name"] == args.variant)
        self.hybrid = HybridConfig.from_dict(variant["hybrid"])
        weights_cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
        rope = weights_cfg.get("rope_parameters") or weights_cfg
        self.theta = float(rope.get("rope_theta", 1e4))
        dispatch.hybrid_attention = self.attention
        self.tokenizer = None

    def model(self, name: str):
        if name not in self.models:
            a, root = self.args, Path(self.args.results) / self.args.variant
            if name == "base":
                m, tok = load_stage(a.model_dir, "base")
            elif name == "window_only":
                m, tok = load_stage(a.model_dir, "converted", hybrid=replace(self.hybrid, formulation="window",
                                                                            feature_map="elu1"))
            elif a.stage == "transfer":  # attention transfer alone, before LoRA
                m, tok = load_stage(a.model_dir, "transfer", hybrid=self.hybrid,
                                    hybrid_layers=root / "transfer" / "hybrid_layers.safetensors")
            elif a.untrained:  # a smoke run before training: the same layers converted, maps at identity
                m, tok = load_stage(a.model_dir, "converted", hybrid=self.hybrid)
            else:
                m, tok = load_stage(a.model_dir, "transfer_lora", hybrid=self.hybrid,
                                    hybrid_layers=root / "transfer" / "hybrid_layers.safetensors",
                                    adapter=root / "lora")
            for mod in m.modules():
                if isinstance(mod, HybridLlamaAttention):
                    mod.register_forward_pre_hook(lambda module, _a: setattr(self, "layer", module))
            self.models[name], self.tokenizer = m, tok
        return self.models[name]

    def use(self, arm: Arm):
        """Select ``arm``: its model, with the trained layers set as the arm asks."""
        self.arm = arm
        m = self.model(arm.model)
        for mod in m.modules():
            if isinstance(mod, HybridLlamaAttention) and arm.model == "lolcats":
                mod.hybrid = replace(self.hybrid, formulation=arm.formulation or self.hybrid.formulation,
                                     sparse_cache=arm.sparse_cache, sinks=arm.sinks)
        return m

    def attention(self, q, k, v, wl, ll, **kw):
        arm = self.arm
        stats = {} if self.on_layer else None
        if arm is None or (arm.op == "project" and stats is None):
            return PROJECT_OP(q, k, v, wl, ll, **kw)
        if arm.op == "project" and kw["formulation"] != "lolcats":
            raise SystemExit("diagnose needs the lolcats formulation")
        o = probe_attention(q, k, v, wl, ll, window=kw["window"], feature_map=kw["feature_map"], gamma=arm.gamma,
                            lin_window=arm.lin_window, count_ref=arm.count_ref, wrap=arm.wrap, theta=self.theta,
                            stats=stats)
        if stats is not None:
            self.on_layer(self.layer, q, k, v, wl, ll, stats)
        return o, None


def book_streams(args, tokenizer) -> dict[str, torch.Tensor]:
    out = {}
    for book in args.books.split(","):
        text = (Path(args.books_dir) / f"{book}.txt").read_text(encoding="utf-8")
        out[book] = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return out


def windows(args, streams) -> list[tuple[str, int]]:
    """(book, end) pairs: ``--windows`` per book at evenly spaced fractions of it (1/(n+1), ...): the
    middle of the book for one, away from front matter; shared by every length."""
    longest = max(map(int, args.lengths.split(",")))
    n = args.windows
    return [(book, longest + (len(ids) - longest) * (i + 1) // (n + 1)) for book, ids in streams.items()
            for i in range(n)]


@torch.no_grad()
def tail_nll(model, ids: torch.Tensor, tail: int, shift: bool, max_pos: int) -> float:
    L = ids.numel()
    start = max_pos - L if shift else 0
    out = model(input_ids=ids[None], position_ids=torch.arange(start, start + L)[None], use_cache=False,
                logits_to_keep=tail + 1)
    logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
    return float(-logp.gather(-1, ids[-tail:, None]).mean())


def cmd_nll(args) -> None:
    probe = Probe(args)
    arms = [parse_arm(s) for s in args.arms.split(",")]
    probe.model("base")
    streams = book_streams(args, probe.tokenizer)
    spans = windows(args, streams)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "nll.jsonl"
    done = set()
    if rows_file.exists():
        done = {(r["arm"], r["book"], r["end"], r["L"]) for r in map(json.loads, rows_file.read_text().splitlines())}
    max_pos = probe.model("base").config.max_position_embeddings
    with rows_file.open("a") as f:
        for arm in arms:
            model = probe.use(arm)
            for book, end in spans:
                for L in lengths:
                    if (arm.name, book, end, L) in done or (arm.shift and L >= max_pos):
                        continue  # a window that ends at the last position has nothing to shift
                    t0 = time.perf_counter()
                    nll = tail_nll(model, streams[book][end - L:end], args.tail, arm.shift, max_pos)
                    row = {"arm": arm.name, "book": book, "end": end, "L": L, "nll": nll,
                           "wall_s": round(time.perf_counter() - t0, 1)}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(json.dumps(row), flush=True)
    summarize(rows_file, out / "nll_summary.md")


def summarize(rows_file: Path, md: Path) -> None:
    """Mean NLL per arm and length, and the paired gap to base (mean and standard error over windows)."""
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    nll = {(r["arm"], r["book"], r["end"], r["L"]): r["nll"] for r in rows}
    lengths = sorted({r["L"] for r in rows})
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = ["| arm | " + " | ".join(f"gap at {L} (NLL)" for L in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for arm in arms:
        cells = []
        for L in lengths:
            keys = [key for key in nll if key[0] == arm and key[3] == L]
            gaps = [nll[key] - nll[("base", *key[1:])] for key in keys if ("base", *key[1:]) in nll]
            mean = sum(nll[key] for key in keys) / len(keys) if keys else float("nan")
            if gaps and arm != "base":
                g = sum(gaps) / len(gaps)
                se = (sum((x - g) ** 2 for x in gaps) / max(len(gaps) - 1, 1) / len(gaps)) ** 0.5
                cells.append(f"{g:+.3f} ± {se:.3f} ({mean:.3f})")
            else:
                cells.append(f"({mean:.3f})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    n = len({key[1:3] for key in nll})
    lines.append(f"\n{n} windows (book, end) per cell; the gap is paired per window, ± its standard error.")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


@torch.no_grad()
def cmd_diagnose(args) -> None:
    probe = Probe(args)
    model = probe.use(Arm("probe", op="probe"))
    cfg = model.config
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4)))
    col = Collector(theta, args.train_len, cfg.max_position_embeddings - args.train_len)
    probe.on_layer = col
    streams = book_streams(args, probe.tokenizer)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for book, end in windows(args, streams):
        for L in lengths:
            col.L, col.tail, col.window_id, col.quadratic = L, args.tail, f"{book}:{end}", L == max(lengths)
            # the same forward scores the tail: the trained variant through the probe's op, unchanged
            nll = tail_nll(model, streams[book][end - L:end], args.tail, False, cfg.max_position_embeddings)
            with (out / "nll.jsonl").open("a") as f:
                f.write(json.dumps({"arm": "probe", "book": book, "end": end, "L": L, "nll": nll}) + "\n")
            print(f"diagnosed {book}:{end} at {L}: NLL {nll:.4f}", flush=True)
            (out / "diagnose.jsonl").write_text("".join(json.dumps(r) + "\n" for r in col.rows))
    report_diagnosis(col.rows, out / "diagnose_summary.md")


@torch.no_grad()
def cmd_check(args) -> None:
    """The probe's op against the project's on one trained layer's real q, k, v (and with an arm off)."""
    probe = Probe(args)
    model = probe.use(Arm("lolcats"))
    got = {}

    def grab(layer, q, k, v, wl, ll, stats):
        got.setdefault("qkv", (layer, q, k, v, wl, ll))

    probe.on_layer = grab
    probe.arm = Arm("probe", op="probe")
    ids = book_streams(args, probe.tokenizer)[args.books.split(",")[0]][:1000]
    model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
    probe.on_layer = None
    layer, q, k, v, wl, ll = got["qkv"]
    ref, _ = PROJECT_OP(q, k, v, wl, ll, window=64, formulation="lolcats", feature_map=layer.op_feature_map())
    mine = probe_attention(q, k, v, wl, ll, window=64, feature_map=layer.op_feature_map())
    err = float((ref - mine).abs().max() / ref.abs().max())
    # decay 1 - 1e-9 and a linear window longer than T must give the same output as no change
    same = [probe_attention(q, k, v, wl, ll, window=64, feature_map=layer.op_feature_map(), lin_window=1024),
            probe_attention(q, k, v, wl, ll, window=64, feature_map=layer.op_feature_map(), gamma=1 - 1e-9)]
    errs = [float((x - mine).abs().max() / mine.abs().max()) for x in same]
    # a linear window of 2 windows is a 128-key sliding window: compare with a dense mask
    T, D = q.shape[2], q.shape[3]
    phi_q, phi_k = resolve_qk_maps(layer.op_feature_map())
    g = q.shape[1] // k.shape[1]
    kern = torch.matmul(phi_q(q.float()), phi_k(k.float()).repeat_interleave(g, 1).transpose(-1, -2))
    d = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    s = torch.matmul(q.float(), k.float().repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~((d >= 0) & (d < 64)), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    gamma, vq = 0.99, v.float().repeat_interleave(g, 1)
    for name, weight, kw in (("linwin:128", ((d >= 64) & (d < 128)).float(), {"lin_window": 128}),
                             ("linwin:320", ((d >= 64) & (d < 320)).float(), {"lin_window": 320}),
                             ("decay:0.99", torch.where(d >= 64, gamma ** (d - 64).clamp(min=0).double(), 0.0).float(),
                              {"gamma": gamma})):
        a, b = torch.sigmoid(wl.float()).view(1, -1, 1, 1), torch.sigmoid(ll.float()).view(1, -1, 1, 1)
        lk = kern * weight
        dense = (a * p @ vq + b * lk @ vq) / (a * p.sum(-1, keepdim=True) + b * lk.sum(-1, keepdim=True))
        arm = probe_attention(q, k, v, wl, ll, window=64, feature_map=layer.op_feature_map(), **kw)
        errs.append(float((arm - dense).abs().max() / dense.abs().max()))
        print(f"{name} vs dense: {errs[-1]:.2e}")
    print(f"probe op vs project op on layer {layer.layer_idx}, T={T}: max rel err {err:.2e}; no-op arms {errs[:2]}")
    if max([err] + errs) > 1e-4:
        raise SystemExit("the probe's op disagrees with the project's")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["nll", "diagnose", "check", "summary"])
    ap.add_argument("--model-dir", default="resources/weights/smollm2")
    ap.add_argument("--results", default="results/smollm2", help="the model's results folder")
    ap.add_argument("--variant", default="lolcats")
    ap.add_argument("--config", default="config/config.yaml")
    ap.add_argument("--books-dir", default="../shared/data/gutenberg")
    ap.add_argument("--books", default="pg2701,pg1342")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--windows", type=int, default=1, help="windows per book")
    ap.add_argument("--arms", default="base,lolcats,window_only,linear_off")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stage", default="transfer_lora", choices=["transfer_lora", "transfer"],
                    help="the trained variant's stage the arms change")
    ap.add_argument("--untrained", action="store_true", help="smoke run: the variant's layers untrained")
    ap.add_argument("--train-len", type=int, default=2048, help="the rows the variant was trained on")
    ap.add_argument("--out", default="results/probe_long_context")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.command == "summary":  # the tables again from the rows written so far
        out = Path(args.out)
        summarize(out / "nll.jsonl", out / "nll_summary.md")
        if (out / "diagnose.jsonl").exists():
            rows = [json.loads(x) for x in (out / "diagnose.jsonl").read_text().splitlines()]
            report_diagnosis(rows, out / "diagnose_summary.md")
        return
    {"nll": cmd_nll, "diagnose": cmd_diagnose, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    main()
