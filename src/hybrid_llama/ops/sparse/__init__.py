"""Hybrid attention with the sparse cache (after LoLA): its settings, how it picks keys, the literal
reference, the torch loop and its batched form, the recurrent step, and the state a prefill leaves."""
