"""Model-level A/B of a sparse hybrid's decode step: the layer's one-call path against the general step.

    python benchmarks/bench_step_path.py --run /path/to/finished/run        # after 64 tokens, 15 rounds
    python benchmarks/bench_step_path.py --run RUN --len 1024 --repeats 11

Loads base and the run's exported recommended variant (``results/smollm2/<recommended>/model``)
twice, fp32. In copy A a one-token step takes the layer's one-call path (q and k go to the native
kernel before RoPE, which it applies); in copy B the layer's config says no native step, so the
step rotates q and k in torch and goes through ``hybrid_attention_step`` (which still runs the same
kernel on the rotated q and k: what a sparse layer did before 57e8b28). Each round prefills
``--len`` tokens and times 16 decode steps of each model, in rotating order; prints the medians
of the per-step medians and of the per-round ratios, with their spread.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM

import hybrid_llama  # noqa: F401  (registers the model type)
from hybrid_llama.eval.decoding import decode_step, prefill
from hybrid_llama.layers.hybrid_attention import HybridConfig, HybridLlamaAttention

REPO = Path(__file__).resolve().parents[1]


class _GeneralStep(HybridConfig):
    """The layer's config, saying that no step may take the one-call path."""

    @property
    def native_steps(self) -> bool:
        return False


def general_step_copy(model):
    for module in model.modules():
        if isinstance(module, HybridLlamaAttention):
            module.hybrid = copy.copy(module.hybrid)
            module.hybrid.__class__ = _GeneralStep
    return model


def step_time(model, ids: torch.Tensor, steps: int) -> float:
    """Median seconds of a one-token step after prefilling ``ids``."""
    token, cache = prefill(model, ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token, cache = decode_step(model, token, cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a finished default run's directory")
    ap.add_argument("--len", type=int, default=64, help="prompt length")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    recommended = yaml.safe_load((REPO / "config/config.yaml").read_text())["recommended"]
    hybrid_dir = run / "results/smollm2" / recommended / "model"
    models = {"base": AutoModelForCausalLM.from_pretrained(run / "resources/weights/smollm2", dtype=torch.float32),
              "one call": AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32),
              "general": general_step_copy(AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32))}
    ids = torch.randint(100, 20000, (1, args.len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():
            step_time(model.eval(), ids, args.steps)  # warm-up
        names = list(models)
        for r in range(args.repeats):
            for name in names[r % 3:] + names[: r % 3]:
                times[name].append(step_time(models[name], ids, args.steps))

    def ratio(num: str, den: str) -> str:
        rs = [a / b for a, b in zip(times[num], times[den])]
        return f"{statistics.median(rs):.3f}x [{min(rs):.3f}-{max(rs):.3f}]"

    print(f"after {args.len} tokens, {args.repeats} rounds of {args.steps} steps, {args.threads} threads: "
          + ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items()))
    print(f"base / one call {ratio('base', 'one call')}; base / general {ratio('base', 'general')}; "
          f"general / one call {ratio('general', 'one call')}")


if __name__ == "__main__":
    main()
