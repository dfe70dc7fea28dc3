"""The sparse cache's settings: the one object that goes from a layer's config to the kernels."""

from __future__ import annotations

from dataclasses import dataclass

CACHE_SCORES = ("sre", "random", "attention")


@dataclass(frozen=True)
class SparseCacheConfig:
    """The sparse cache's settings; ``size`` 0 and ``sinks`` 0 switch it off (the plain hybrid op)."""

    size: int = 0
    sinks: int = 0
    score: str = "sre"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"sparse cache size must be an integer >= 0, got {self.size!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if self.score not in CACHE_SCORES:
            raise ValueError(f"cache_score must be one of {CACHE_SCORES}, got {self.score!r}")

    @property
    def active(self) -> bool:
        return self.size > 0 or self.sinks > 0

    def softmax_prompt_len(self, window: int) -> int:
        """The longest prompt (without padding) in which no query sees a folded key, so the op is causal
        softmax over it: ``window`` without the cache. With it, block J closes at t = sinks + (J + 2) w
        - 1 among (J + 1) w candidates, and the first close with more than ``size`` of them folds."""
        if not self.active:
            return window
        return self.sinks + (self.size // window + 2) * window - 1

    def require_formulation(self, formulation: str) -> SparseCacheConfig:
        """This config, checked for ``formulation``: the cache is defined for the shared normalizer only."""
        if self.active and formulation != "lolcats":
            raise ValueError(
                f"sparse_cache/sinks need formulation='lolcats' (one normalizer shared by the exact keys and the "
                f"linear state); got formulation={formulation!r}"
            )
        return self

    @property
    def state_needs_queries(self) -> bool:
        """The ``attention`` score's state holds what each key received from the queries, so it cannot
        be built from the keys alone (``window_prompt_state``)."""
        return self.active and self.score == "attention"
