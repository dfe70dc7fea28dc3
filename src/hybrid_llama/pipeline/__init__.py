"""The workflow's side of the library: artifact paths, per-rule config views, config checks.

Importable without torch (the Snakefile imports it at parse time), and it imports nothing from
``hybrid_llama.train`` or ``hybrid_llama.eval``: the library never depends on the workflow's layer.

- ``paths``: the table of every artifact's path (``PATHS``, ``path``, ``parse_result_path``) and
  the wildcards; the stage names and MMLU formats (from ``hybrid_llama.names``).
- ``views``: ``Pipeline``, a validated config with the per-rule views of it and the target lists.
- ``checks``: the semantic checks JSON Schema cannot express (``Pipeline.check`` runs them).

Config loading, defaults and merging live in ``hybrid_llama.config``; they are re-exported here so
existing ``from hybrid_llama.pipeline import ...`` lines keep working.
"""

from hybrid_llama.config import (
    SCHEMA_PATH,
    ConfigError,
    canonical,
    deep_merge,
    hybrid_defaults,
    load_schema,
    schema_defaults,
    settings_key,
)

from .paths import (
    MMLU_FORMATS,
    PATHS,
    QUALITY_KINDS,
    SHARED_STAGES,
    STAGE_ARTIFACTS,
    STAGE_LABELS,
    STAGES,
    VARIANT_STAGES,
    WILDCARD_PATTERNS,
    is_cuda,
    parse_result_path,
    path,
    shared_data_dir,
)
from .views import Pipeline

__all__ = [
    "MMLU_FORMATS",
    "PATHS",
    "QUALITY_KINDS",
    "SCHEMA_PATH",
    "SHARED_STAGES",
    "STAGES",
    "STAGE_ARTIFACTS",
    "STAGE_LABELS",
    "VARIANT_STAGES",
    "WILDCARD_PATTERNS",
    "ConfigError",
    "Pipeline",
    "canonical",
    "deep_merge",
    "hybrid_defaults",
    "is_cuda",
    "load_schema",
    "parse_result_path",
    "path",
    "schema_defaults",
    "settings_key",
    "shared_data_dir",
]
