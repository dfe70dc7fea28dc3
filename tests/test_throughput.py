"""Throughput harness on a tiny model: schema, lengths, cache sizes, OOM rows, cached decode = uncached."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybrid_llama.eval.throughput import COLUMNS, greedy_decode, measure_throughput, write_csv
from hybrid_llama.models import load_model

LENS = [2**i for i in range(7)]  # 1 .. 64
WINDOW = 4


def tiny_model(model_dir, seed: int = 0) -> LlamaForCausalLM:
    """The shared tiny random Llama; ``seed`` re-draws its weights (decode checks on several models)."""
    model, _tok = load_model(model_dir, dtype=torch.float32)
    if seed:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(model.config).eval()
    return model


def tiny_hybrid(model_dir, seed: int = 0, backend: str = "chunked") -> LlamaForCausalLM:
    from hybrid_llama.models import convert_to_hybrid

    model = tiny_model(model_dir, seed)
    convert_to_hybrid(model, list(range(model.config.num_hidden_layers)), window=WINDOW, backend=backend)
    with torch.no_grad():  # make the linear part matter: mixing logits away from their symmetric init
        torch.manual_seed(seed + 1)
        for layer in model.model.layers:
            layer.self_attn.mixing.window_logit.uniform_(-1, 1)
            layer.self_attn.mixing.linear_logit.uniform_(-1, 1)
    return model.eval()


@pytest.fixture(scope="module")
def table(tiny_model_dir):
    variants = {"base": (tiny_model(tiny_model_dir), None, "sdpa"),
                "hybrid_chunked": lambda: (tiny_hybrid(tiny_model_dir), None, "chunked")}
    return measure_throughput(variants, seq_lens=list(reversed(LENS)), decode_tokens=3, repeats=2, warmup=1,
                              device="cpu", dtype="float32", batch=2)


def test_schema_and_lengths(table, tmp_path):
    import pandas as pd

    assert list(table.columns) == COLUMNS
    assert (table["status"] == "ok").all(), table[table["status"] != "ok"][["variant", "seq_len", "error"]]
    assert set(table["variant"]) == {"base", "hybrid_chunked"}
    assert set(table["phase"]) == {"prefill", "decode"}
    for (_v, _p), g in table.groupby(["variant", "phase"]):
        assert list(g["seq_len"]) == LENS  # sorted ascending, every length once
    assert (table["tokens_per_s"] > 0).all() and (table["peak_mem_bytes"] > 0).all()
    assert (table["device_name"] == "cpu").all() and (table["dtype"] == "float32").all()
    assert (table["batch"] == 2).all()
    # tokens/s and s/token describe the same median time
    pre = table[table["phase"] == "prefill"]
    assert (pre["tokens_per_s"] * pre["s_per_token"]).to_numpy() == pytest.approx(2.0)  # batch 2
    dec = table[table["phase"] == "decode"]
    assert dec["time_s"].to_numpy() == pytest.approx((dec["s_per_token"] * 3).to_numpy())
    back = pd.read_csv(write_csv(table, tmp_path / "cpu.csv"))
    assert list(back.columns) == COLUMNS and len(back) == len(table) == 2 * 2 * len(LENS)


def test_cache_bytes(table, tiny_model_dir):
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    base = table[(table["variant"] == "base") & (table["phase"] == "prefill")]
    for n, got in zip(base["seq_len"], base["cache_bytes"]):
        # keys + values, fp32, every layer: grows linearly with the prompt
        assert got == 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * n * head_dim * 4  # batch 2
    hyb = table[(table["variant"] == "hybrid_chunked") & (table["phase"] == "prefill")]
    sizes = dict(zip(hyb["seq_len"], hyb["cache_bytes"]))
    base_sizes = dict(zip(base["seq_len"], base["cache_bytes"]))
    # a prompt inside the window is held as its keys and values, as base holds it (every layer is hybrid)
    assert all(sizes[n] == base_sizes[n] for n in LENS if n <= WINDOW)
    # past the window: a constant-size state (ring of w keys and values, S, z), above the bare window
    assert len({sizes[n] for n in LENS if n > WINDOW}) == 1
    assert sizes[64] > sizes[WINDOW] and sizes[64] < base_sizes[64]


@pytest.mark.parametrize("kind", ["base", "hybrid"])
@pytest.mark.parametrize("prompt_len", [1, 11, 40])
def test_cached_decode_equals_uncached(kind, prompt_len, tiny_model_dir):
    model = tiny_model(tiny_model_dir, 1) if kind == "base" else tiny_hybrid(tiny_model_dir, 1)
    ids = torch.randint(
        0, model.config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len)
    )
    with_cache = greedy_decode(model, ids, 12, use_cache=True)
    without = greedy_decode(model, ids, 12, use_cache=False)
    assert with_cache.shape == (2, 12)
    assert torch.equal(with_cache, without)
    # the uncached path is plain full-sequence argmax: check its first token independently
    assert torch.equal(without[:, 0], model(ids).logits[:, -1].argmax(-1))


class _OomAbove(LlamaForCausalLM):
    """Raises CUDA-style OOM for prompts longer than 8 tokens."""

    def forward(self, input_ids=None, **kw):
        if input_ids.shape[1] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return super().forward(input_ids=input_ids, **kw)


class _VirtualClock:
    """A clock that moves only when a model says it ran: timings known exactly, no sleeping."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, []

    def perf_counter(self) -> float:
        return self.now


class _Costed(LlamaForCausalLM):
    """Advances the virtual clock by ``cost`` seconds per forward, 1.5x that in every other spell of
    ``spell`` forwards (of any model): a machine whose speed drifts."""

    def __init__(self, config, name: str, cost: float, clock: _VirtualClock, spell: int):
        super().__init__(config)
        self.name, self.cost, self.clock, self.spell = name, cost, clock, spell

    def forward(self, input_ids=None, **kw):
        self.clock.calls.append(self.name)
        drift = 1 + 0.5 * ((len(self.clock.calls) - 1) // self.spell % 2)
        self.clock.now += self.cost * drift
        return super().forward(input_ids=input_ids, **kw)


def _costed_pair(tiny_model_dir, clock: _VirtualClock, spell: int) -> dict:
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    return {"base": (_Costed(cfg, "base", 1.0, clock, spell).eval(), None, "sdpa"),
            "slow": (_Costed(cfg, "slow", 4.0, clock, spell).eval(), None, "x")}


def test_variants_interleave_and_pair_with_base(tiny_model_dir, monkeypatch):
    from hybrid_llama.eval import throughput

    clock = _VirtualClock()
    monkeypatch.setattr(throughput, "time", clock)
    # 4 forwards a round (2 prefills, 2 decode steps): every other round is slower
    df = measure_throughput(_costed_pair(tiny_model_dir, clock, spell=4), seq_lens=[2, 4], decode_tokens=1,
                            repeats=3, warmup=1)
    # 2 lengths x 4 rounds; the prefills take turns, then the decode steps; the order rotates by round
    assert clock.calls == ["base", "slow", "base", "slow", "slow", "base", "slow", "base"] * 4
    slow, base = df[df["variant"] == "slow"], df[df["variant"] == "base"]
    # paired within each round the drift cancels: exactly 1/4 in every round, so no spread
    assert slow["speedup"].to_numpy() == pytest.approx(0.25)
    assert slow["speedup_min"].to_numpy() == pytest.approx(0.25)
    assert slow["speedup_max"].to_numpy() == pytest.approx(0.25)
    assert (base["speedup"] == 1.0).all()
    # while each variant's own times spread with the drift
    assert (slow["time_s_max"] / slow["time_s_min"]).to_numpy() == pytest.approx(1.5)


def test_decode_steps_take_turns_within_a_round(tiny_model_dir, monkeypatch):
    """A slow spell shorter than a round (2 forwards) hits base and the variant alike, because their
    decode steps alternate (who goes first rotating by step); timed one variant after the other,
    the spell would land on whichever ran during it and the ratio would swing by round."""
    from hybrid_llama.eval import throughput

    clock = _VirtualClock()
    monkeypatch.setattr(throughput, "time", clock)
    df = measure_throughput(_costed_pair(tiny_model_dir, clock, spell=2), seq_lens=[3], decode_tokens=4,
                            repeats=3, warmup=0)
    assert clock.calls[:10] == ["base", "slow"] + ["base", "slow", "slow", "base"] * 2
    slow = df[(df["variant"] == "slow")].set_index("phase")
    for phase in ("prefill", "decode"):
        assert slow.loc[phase, ["speedup", "speedup_min", "speedup_max"]].to_numpy() == pytest.approx(0.25)
    # the decode phase is the sum of its steps: 4 steps, half of them in slow spells
    assert slow.loc["decode", "time_s"] == pytest.approx(4.0 * (1 + 1.5 + 1 + 1.5))


class _Interrupted(_Costed):
    """As ``_Costed`` (no drift), but its own ``at``-th forward takes ``extra`` seconds more: another
    process had the CPU during that one call."""

    def __init__(self, config, name: str, cost: float, clock: _VirtualClock, at: int, extra: float):
        super().__init__(config, name, cost, clock, spell=10**6)
        self.at, self.extra, self.forwards = at, extra, 0

    def forward(self, input_ids=None, **kw):
        self.forwards += 1
        if self.forwards == self.at:
            self.clock.now += self.extra
        return super().forward(input_ids=input_ids, **kw)


@pytest.mark.parametrize("interrupted", ["base", "slow"])
@pytest.mark.parametrize("phase,at", [("prefill", 8), ("decode", 12)])
def test_an_interrupted_call_moves_neither_time_nor_ratio(tiny_model_dir, monkeypatch, interrupted, phase, at):
    """A round's phase is its median call: one call stretched by 30 s (of either variant, in a short
    prefill or a decode step) leaves every time and ratio as without it; a mean over the round's calls
    would carry the 30 s into one variant's time and move the ratio far from 0.5."""
    from hybrid_llama.eval import throughput

    clock = _VirtualClock()
    monkeypatch.setattr(throughput, "time", clock)
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    costs = {"base": 1.0, "slow": 2.0}
    variants = {name: (_Interrupted(cfg, name, cost, clock, at if name == interrupted else -1, 30.0).eval(), None,
                       "x") for name, cost in costs.items()}
    # warm-up round: 1 prefill + 5 steps each (forwards 1-6); 5 s / 2 s -> 3 prefills each in the timed
    # round (forwards 7-9), then 5 steps (10-14)
    df = measure_throughput(variants, seq_lens=[3], decode_tokens=5, repeats=1, warmup=1, prefill_min_s=5.0)
    assert (df["prefill_calls"] == 3).all()
    slow = df[df["variant"] == "slow"].set_index("phase")
    base = df[df["variant"] == "base"].set_index("phase")
    assert slow.loc[phase, "speedup"] == pytest.approx(0.5)
    assert base.loc["prefill", "time_s"] == pytest.approx(1.0) and slow.loc["prefill", "time_s"] == pytest.approx(2.0)
    assert base.loc["decode", "time_s"] == pytest.approx(5.0) and slow.loc["decode", "time_s"] == pytest.approx(10.0)


def test_short_prefills_repeat_within_a_round(tiny_model_dir, monkeypatch):
    """Prefills quicker than prefill_min_s run several times per round, the variants taking turns;
    the count comes from the slowest variant in the first round, the time reported is per call."""
    from hybrid_llama.eval import throughput

    clock = _VirtualClock()
    monkeypatch.setattr(throughput, "time", clock)
    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    variants = {"base": (_Costed(cfg, "base", 0.1, clock, spell=10**6).eval(), None, "sdpa"),
                "slow": (_Costed(cfg, "slow", 0.2, clock, spell=10**6).eval(), None, "x")}
    df = measure_throughput(variants, seq_lens=[3], decode_tokens=1, repeats=1, warmup=1, prefill_min_s=0.5)
    # round 1 (warm-up): one prefill each; 0.5 s / 0.2 s -> 3 prefills each in round 2, turns rotating
    assert clock.calls == (["base", "slow"] * 2 + ["slow", "base"] + ["base", "slow", "slow", "base"]
                           + ["slow", "base"])
    slow = df[df["variant"] == "slow"].set_index("phase")
    assert (df["prefill_calls"] == 3).all()
    assert slow.loc["prefill", "time_s"] == pytest.approx(0.2)  # per call
    assert slow.loc["prefill", "speedup"] == pytest.approx(0.5)
    assert slow.loc["decode", "time_s"] == pytest.approx(0.2)


def test_oom_is_a_row_not_a_crash(tiny_model_dir):
    model = _OomAbove(LlamaConfig.from_pretrained(tiny_model_dir)).eval()
    df = measure_throughput(
        {"oomy": (model, None, "sdpa")}, seq_lens=[4, 8, 16, 32], decode_tokens=2, repeats=1, warmup=0, device="cpu"
    )
    status = dict(zip(df[df["phase"] == "prefill"]["seq_len"], df[df["phase"] == "prefill"]["status"]))
    assert status == {4: "ok", 8: "ok", 16: "oom", 32: "skipped"}
    assert math.isnan(df[(df["seq_len"] == 16)]["tokens_per_s"].iloc[0])


def test_broken_variant_is_recorded(tiny_model_dir):
    def broken():
        raise ValueError("no such backend")

    df = measure_throughput(
        {"bad": broken, "base": (tiny_model(tiny_model_dir), None, "sdpa")},
        seq_lens=[2],
        decode_tokens=1,
        repeats=1,
        warmup=0,
    )
    assert set(df[df["variant"] == "bad"]["status"]) == {"error"}
    assert "no such backend" in df[df["variant"] == "bad"]["error"].iloc[0]
    assert set(df[df["variant"] == "base"]["status"]) == {"ok"}


def test_build_variants_from_model_dir(tiny_model_dir):
    from hybrid_llama.eval.throughput import build_throughput_variants, seed_naive_available
    from hybrid_llama.layers import HybridLlamaAttention

    variants = build_throughput_variants(tiny_model_dir, {"layers": [0, 2], "window": WINDOW}, "cpu", "float32")
    expected = {"base", "hybrid_chunked"} | ({"hybrid_seed_naive"} if seed_naive_available() else set())
    assert set(variants) == expected  # no triton variant without CUDA
    model, tok, backend = variants["hybrid_chunked"]()
    assert backend == "chunked" and tok is not None
    kinds = [isinstance(layer.self_attn, HybridLlamaAttention) for layer in model.model.layers]
    assert kinds == [True, False, True, False]
    assert all(layer.self_attn.hybrid.backend == "chunked" for i, layer in enumerate(model.model.layers) if kinds[i])
    base, _, label = variants["base"]()
    assert label == "sdpa" and base.config._attn_implementation == "sdpa"
    df = measure_throughput(variants, seq_lens=[1, 8], decode_tokens=2, repeats=1, warmup=0)
    assert (df["status"] == "ok").all(), df[["variant", "status", "error"]]


# ------------------------------------------------------------- benchmarks/bench_model.py (model level)


def _bench_model():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"
    spec = importlib.util.spec_from_file_location("bench_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_model_ratios_and_goals(tmp_path):
    """A CPU run of the model-level benchmark: its ratios are the tables' own numbers, divided."""
    import json

    bench = _bench_model()
    out = tmp_path / "bench.json"
    argv = [
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--backends",
        "chunked",
        "--prefill-lens",
        "32,96",
        "--decode-context",
        "96",
        "--decode-batch",
        "2",
        "--decode-tokens",
        "3",
        "--repeats",
        "1",
        "--formulation",
        "lolcats",
        "--sparse-cache",
        "8",
        "--sinks",
        "2",
        "--hybrid",
        '{"decay": 0.9995}',
        "--base-softmax-layers",
        "--json",
        str(out),
        "--csv",
        str(tmp_path / "throughput.csv"),
    ]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["layers"] == [0, 2]  # "even" layers of the 4-layer tiny model
    assert res["hybrid"]["decay"] == 0.9995  # the hybrid settings measured are recorded with the run
    # the CSV holds both sweeps' rows and draws with the report's own throughput plot
    import pandas as pd

    from hybrid_llama.report.plots import plot_throughput

    csv = pd.read_csv(tmp_path / "throughput.csv")
    assert len(csv) == len(res["prefill"]) + len(res["decode"])
    assert {"variant", "seq_len", "phase", "tokens_per_s", "cache_bytes"} <= set(csv.columns)
    assert all(p.stat().st_size > 0 for p in plot_throughput(tmp_path / "throughput.csv", tmp_path / "plot"))

    def pick(table, variant, seq_len, phase, col):
        (row,) = [r for r in res[table] if (r["variant"], r["seq_len"], r["phase"]) == (variant, seq_len, phase)]
        assert row["status"] == "ok" and row["batch"] == (1 if table == "prefill" else 2)
        return row[col]

    r = res["ratios"]["hybrid_chunked"]
    assert r["prefill_speedup"] == pytest.approx(
        pick("prefill", "hybrid_chunked", 96, "prefill", "tokens_per_s")
        / pick("prefill", "base", 96, "prefill", "tokens_per_s")
    )
    assert r["decode_speedup"] == pytest.approx(
        pick("decode", "hybrid_chunked", 96, "decode", "tokens_per_s")
        / pick("decode", "base", 96, "decode", "tokens_per_s")
    )
    # cache: 2 of 4 layers keep the 96-token KV cache, 2 keep a 64-slot window + a D x D state
    assert r["cache_ratio"] == pytest.approx(
        pick("decode", "hybrid_chunked", 96, "decode", "cache_bytes")
        / pick("decode", "base", 96, "decode", "cache_bytes")
    )
    assert 0.5 < r["cache_ratio"] < 1.0
    # the sparse-cache variant: same layers plus 8 keys and 2 sinks per KV head, so a larger cache
    sparse = res["ratios"]["sparse_chunked"]
    assert r["cache_ratio"] < sparse["cache_ratio"]
    assert sparse["decode_speedup"] == pytest.approx(pick("decode", "sparse_chunked", 96, "decode", "speedup"))
    # base with every layer the hybrid's softmax layer: the same prompt keeps a cache of base's size
    same = res["ratios"]["base_softmax_layers"]
    assert same["cache_ratio"] == 1.0
    assert same["decode_speedup"] == pytest.approx(pick("decode", "base_softmax_layers", 96, "decode", "speedup"))


def test_bench_model_goal_verdicts():
    import pandas as pd

    bench = _bench_model()
    rows = [
        dict(variant=v, phase=p, seq_len=n, status=s, tokens_per_s=t, cache_bytes=c)
        for v, p, n, s, t, c in [
            ("base", "prefill", 8, "ok", 100.0, 10),
            ("hyb", "prefill", 8, "ok", 150.0, 5),
            ("base", "decode", 8, "ok", 10.0, 10),
            ("hyb", "decode", 8, "oom", 0.0, 5),
        ]
    ]
    frame = pd.DataFrame(rows)
    r = bench.model_ratios(frame, frame, prefill_len=8, decode_context=8)["hyb"]
    assert r["prefill_speedup"] == pytest.approx(1.5) and math.isnan(r["decode_speedup"])
    assert bench.meets("prefill_speedup", 1.5) == "meets >= 1.3"
    assert bench.meets("cache_ratio", 0.6) == "misses <= 0.55"
    assert bench.meets("decode_speedup", r["decode_speedup"]) == "not measured"
