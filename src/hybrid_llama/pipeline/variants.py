"""Derived variants: ``from: parent`` gives a variant its parent's settings and trained artifacts.

A derived variant is a config feature, not a copy of files: its stages are built from the parent's
transfer layers and LoRA adapter unless it sets a ``transfer`` or ``lora`` of its own, and then
only that stage trains for it (a LoRA stage from the parent's transfer). Its hybrid block may
change only the keys that leave trained weights valid (``EVAL_ONLY_HYBRID``).
"""

from __future__ import annotations

from hybrid_llama.config import SPARSE_CACHE_KEYS, ConfigError, deep_merge

# Hybrid keys a derived variant may change: they leave the trained weights valid.
EVAL_ONLY_HYBRID = (*SPARSE_CACHE_KEYS, "softmax_heads", "backend")


def resolve_variants(own: dict[str, dict]) -> dict[str, dict]:
    """{name: settings} with every parent's settings filled in; raises ConfigError (naming the key)
    for an unknown parent, a cycle, or a change to a key the parent's weights depend on."""
    return {v: _resolved(own, v, ()) for v in own}


def _resolved(own: dict[str, dict], v: str, chain: tuple[str, ...]) -> dict:
    entry = own[v]
    parent = entry.get("from")
    if parent is None:
        return entry
    key = f"variants[{v}].from"
    if parent not in own:
        raise ConfigError(key, f"no variant named '{parent}' to derive from (variants: {sorted(own)})")
    if parent in chain + (v,):
        raise ConfigError(key, f"derivation cycle {' -> '.join(chain + (v, parent))}")
    base = _resolved(own, parent, chain + (v,))
    for k, value in (entry.get("hybrid") or {}).items():
        if k not in EVAL_ONLY_HYBRID and value != base["hybrid"].get(k):
            raise ConfigError(
                f"variants[{v}].hybrid.{k}",
                f"a variant derived from '{parent}' reuses its trained layers, so it may change only "
                f"{', '.join(EVAL_ONLY_HYBRID)}",
            )
    merged = deep_merge({k: x for k, x in base.items() if k != "description"}, entry)
    merged["hybrid"] = {**base["hybrid"], **(entry.get("hybrid") or {})}
    return merged


def transfer_owner(own: dict[str, dict], variant: str) -> str:
    """The variant whose transfer artifacts ``variant``'s models use: its own, unless it derives
    from a parent and sets no 'transfer' of its own."""
    parent = own[variant].get("from")
    if parent is None or "transfer" in own[variant]:
        return variant
    return transfer_owner(own, parent)


def lora_owner(own: dict[str, dict], variant: str) -> str:
    """The variant whose adapter ``variant``'s transfer_lora stage uses: its own when it trains its
    own transfer or sets a 'lora' of its own, else its parent's."""
    parent = own[variant].get("from")
    if parent is None or "lora" in own[variant] or transfer_owner(own, variant) == variant:
        return variant
    return lora_owner(own, parent)
