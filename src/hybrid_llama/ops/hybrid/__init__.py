"""Hybrid attention without the sparse cache: the naive reference, the chunked form, the recurrent
step, and the published recreation's implementation (``seed_naive``)."""
