"""Configuration values: the schema's defaults, merging, and the canonical form of settings.

The JSON Schema (``schema.yaml``) is the single source of every default. The training code builds
its typed settings from here and the workflow validates configs against it, so the workflow, the
library and the CLIs train the same recipe.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import yaml

SCHEMA_PATH = Path(__file__).with_name("schema.yaml")


class ConfigError(ValueError):
    """A config value the workflow cannot run with; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"Invalid config value at '{key}': {message}")
        self.key = key


@functools.lru_cache(maxsize=1)
def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _property_defaults(node: dict) -> dict[str, Any]:
    """The defaults of a schema object's properties, its own and its ``allOf`` parts', in schema order."""
    schema = load_schema()
    defaults: dict[str, Any] = {}
    for sub in [node, *node.get("allOf", [])]:
        if "$ref" in sub:
            sub = schema["$defs"][sub["$ref"].split("/")[-1]]
        for key, prop in sub.get("properties", {}).items():
            if "default" in prop:
                defaults[key] = copy.deepcopy(prop["default"])
    return defaults


def schema_defaults(section: str) -> dict[str, Any]:
    """The defaults the schema gives a top-level section (e.g. "transfer", "lora"), keys in schema order."""
    return _property_defaults(load_schema()["properties"][section])


def hybrid_defaults() -> dict[str, Any]:
    """The defaults of a variant's ``hybrid`` block (everything but ``layers``). ``HybridConfig`` repeats
    them as its field defaults (the layers do not read the schema); a test keeps the two equal."""
    return _property_defaults(load_schema()["$defs"]["hybrid"])


def deep_merge(base: dict, override: dict | None) -> dict:
    """A copy of ``base`` with ``override``'s keys replacing base's (recursively for dicts)."""
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def canonical(obj: Any) -> Any:
    """``obj`` with every dict's keys sorted: Snakemake compares params as text, so the order of keys
    in a config file must not look like a change."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [canonical(x) for x in obj]
    return obj


def settings_key(*parts: Any) -> str:
    """A short hash of settings (checkpoint directories are keyed by it: a changed config never
    resumes a stale run)."""
    import hashlib

    return hashlib.sha256(json.dumps(canonical(list(parts)), sort_keys=True).encode()).hexdigest()[:12]




# A hybrid block's sparse-cache keys (ops.SparseCacheConfig's size, sinks and score).
SPARSE_CACHE_KEYS = ("sparse_cache", "sinks", "cache_score")


def without_unused_hybrid_keys(hybrid: dict) -> dict:
    """A hybrid block as saved and as rules get it: the sparse-cache keys only while the cache is on
    (some keys or sinks), ``softmax_heads`` only when it names heads, ``decay`` only when set; so
    neither a config.json nor a rule's params change for a model that never uses them."""
    h = dict(hybrid)
    if not (h.get("sparse_cache") or h.get("sinks")):
        for key in SPARSE_CACHE_KEYS:
            h.pop(key, None)
    if not h.get("softmax_heads", True):
        del h["softmax_heads"]
    if "decay" in h and h["decay"] is None:
        del h["decay"]
    return h
