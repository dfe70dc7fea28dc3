"""The model card (README.md) written next to every saved hybrid.

The usual Hugging Face header (base_model, library_name, license, tags, pipeline_tag), what the
model is (base, hybrid layers, window, formulation, feature map, sparse cache), its training and
results as the caller measured them, and how to load it. Sections the caller has no numbers for
say "not measured": the card never states a number that is not in a result file.
"""

from __future__ import annotations

import json
from typing import Any

from hybrid_llama.layers import HybridConfig

NOT_MEASURED = "not measured"
TAGS = ("hybrid-llama", "hybrid_llama", "linear-attention", "sliding-window-attention", "linearized")


def _yaml_scalar(value: str) -> str:
    # JSON strings are valid YAML scalars: quotes and colons in names stay safe.
    return json.dumps(value, ensure_ascii=False)


def _header(base_model: str | None, license: str | None) -> str:
    lines = ["---"]
    if base_model:
        lines.append(f"base_model: {_yaml_scalar(base_model)}")
    lines.append("library_name: transformers")
    if license:
        lines.append(f"license: {_yaml_scalar(license)}")
    lines.append("pipeline_tag: text-generation")
    lines.append("tags:")
    lines += [f"- {t}" for t in TAGS]
    lines.append("---")
    return "\n".join(lines)


def hybrid_table(hybrid: HybridConfig | dict[str, Any], base: str | None, num_layers: int | None = None) -> str:
    """The markdown table of what the model is: base model and every hybrid setting."""
    cfg = hybrid if isinstance(hybrid, HybridConfig) else HybridConfig.from_dict(dict(hybrid))
    layers = ", ".join(map(str, cfg.layers)) + (f" (of {num_layers})" if num_layers else "")
    if cfg.sparse.active:
        sparse = (f"{cfg.sparse_cache} keys per KV head kept exactly (score `{cfg.cache_score}`), "
                  f"{cfg.sinks} attention sinks")
    else:
        sparse = "none"
    rows = [("base model", base or "not recorded"), ("hybrid layers", layers),
            ("softmax window", f"{cfg.window} tokens"), ("formulation", f"`{cfg.formulation}`"),
            ("feature map", f"`{cfg.feature_map}`"), ("sparse cache", sparse)]
    if cfg.softmax_heads:
        heads = ", ".join(f"layer {layer} KV head {head}" for layer, head in cfg.softmax_heads)
        rows.append(("heads kept softmax (whole context)", heads))
    rows.append(("attention backend", f"`{cfg.backend}`"))
    return "| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def model_card(
    hybrid: HybridConfig | dict[str, Any],
    *,
    name: str = "A hybrid-attention Llama",
    base_model: str | None = None,
    base_model_id: str | None = None,
    license: str | None = None,
    num_layers: int | None = None,
    training: str | None = None,
    results: str | None = None,
    path: str = "path/to/this/directory",
) -> str:
    """README.md text. ``base_model_id`` (a Hub id) goes into the header, ``base_model`` (any
    description) into the table; ``training`` and ``results`` are markdown the caller built from
    its result files (None: "not measured"); ``path`` is the directory in the loading examples."""
    how = f"""## How to load

`config.json` has `model_type: hybrid_llama`. Importing `hybrid_llama` registers that type with
transformers' Auto classes (no `trust_remote_code`, no pickle: safetensors and JSON only):

```python
import hybrid_llama  # registers model_type "hybrid_llama"
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
out = model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=20)  # recurrent cache
```

Without `import hybrid_llama`, transformers stops with its unknown-model-type error; it never
loads a plain Llama that would ignore the hybrid layers. Evaluate it with lm-eval's own command line:

```bash
python -m hybrid_llama.lm_eval --model hf --model_args pretrained={path} --tasks <task>
```
"""
    parts = [
        _header(base_model_id, license),
        f"# {name}",
        "A Llama whose attention in the layers below is **hybrid**: softmax over a sliding window plus "
        "linear attention over every older token, mixed by learned per-head factors (built by the "
        "hybrid-llama pipeline; its docs/design.md gives the exact semantics). Decoding keeps a "
        "constant-size recurrent state in those layers.",
        "## Model\n\n" + hybrid_table(hybrid, base_model, num_layers),
        "## Training\n\n" + (training or NOT_MEASURED),
        "## Results\n\n" + (results or NOT_MEASURED),
        how,
    ]
    return "\n\n".join(p.strip() for p in parts) + "\n"
