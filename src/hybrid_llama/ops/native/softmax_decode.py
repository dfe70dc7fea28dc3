"""A softmax layer's decode step: one new query per head attending to the layer's whole KV cache.

A hybrid model keeps half its layers softmax, and at long contexts their KV caches are most of the
bytes a decode step reads. ``softmax_decode`` runs the step as one native call (``cpu_kernels.c``'s
``softmax_decode_f32``): the keys are split into chunks that torch's threads share, each chunk reads
its key and value rows once for all the query heads of its KV head, and the chunks' partial softmaxes
are merged. ``softmax_decode_reference`` is the step written out, which the kernel is tested against.

The KV cache is the state here, and the cache layer that owns it has already appended the new key, so
the step returns the output only.

Covered: CPU fp32 without autograd; q ``[B, H, 1, D]`` and k, v ``[B, H_kv, L, D]`` whose last dim is
contiguous (views of a cache buffer with spare capacity included); H a multiple of H_kv with at most 16
query heads per KV head; D a multiple of 16 up to 256; no mask. Anything else returns None and the
caller runs SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..gqa import expand_kv
from . import build
from .bindings import Kernel
from .build import DECODE_G, MAX_D

DECODE, WORKSPACE = Kernel("softmax_decode_f32"), Kernel("softmax_decode_workspace")

KEYS_PER_CHUNK = 512  # a chunk's keys at long contexts: enough chunks for every thread, few partials to merge
MIN_KEYS_PER_CHUNK = 64  # cpu_kernels.c's block of scores
MIN_CHUNKS_PER_THREAD = 2
MAX_GROUP = DECODE_G  # query heads per KV head


def softmax_decode_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``softmax(q k^T * scale) v`` for one query per head: q ``[B, H, 1, D]``, k, v ``[B, H_kv, L, D]``
    -> ``[B, H, 1, D]``, the scores in fp32."""
    k, v = expand_kv(q, k, v)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def keys_per_chunk(L: int, heads: int, threads: int) -> int:
    """Keys per chunk for ``heads`` (batch rows times KV heads) caches of L keys on ``threads``: chunks of
    at most KEYS_PER_CHUNK keys, at least MIN_CHUNKS_PER_THREAD per thread where L allows, and a number of
    them that the threads share evenly."""
    n = max(-(-L // KEYS_PER_CHUNK), -(-MIN_CHUNKS_PER_THREAD * threads // heads))
    while (n * heads) % threads and n < L:
        n += 1
    n = min(n, max(1, L // MIN_KEYS_PER_CHUNK))
    return -(-L // n)


def _covered(q: Tensor, k: Tensor, v: Tensor) -> bool:
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != 1 or k.shape != v.shape:
        return False
    B, H, _, D = q.shape
    Hk = k.shape[1]
    return (
        k.shape[0] == B and k.shape[3] == D and k.shape[2] >= 1 and H % Hk == 0 and H // Hk <= MAX_GROUP
        and D % 16 == 0 and D <= MAX_D
        and all(t.dtype == torch.float32 and t.is_cpu and t.stride(-1) == 1 for t in (q, k, v))
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    )


def softmax_decode(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """The step natively: ``[B, H, 1, D]`` (a view of ``[B, 1, H, D]`` memory, the layout the output
    projection reads), or None when the kernel does not cover the arguments (see the module's doc)."""
    if not build.enabled() or not _covered(q, k, v):
        return None
    if build.load() is None:
        return None
    B, H, _, D = q.shape
    Hk, L = k.shape[1], k.shape[2]
    threads = torch.get_num_threads()
    chunk = keys_per_chunk(L, B * Hk, threads)
    out = q.new_empty((B, 1, H, D))
    work = q.new_empty(WORKSPACE(B=B, H=H, Hk=Hk, D=D, L=L, chunk=chunk))
    code = DECODE(
        B=B, H=H, Hk=Hk, D=D, L=L, chunk=chunk, threads=threads,
        q=q.data_ptr(), q_b=q.stride(0), q_h=q.stride(1),
        k=k.data_ptr(), k_b=k.stride(0), k_h=k.stride(1), k_t=k.stride(2),
        v=v.data_ptr(), v_b=v.stride(0), v_h=v.stride(1), v_t=v.stride(2),
        scale=float(scale), out=out.data_ptr(), o_b=out.stride(0), o_h=out.stride(2), work=work.data_ptr(),
    )
    return None if code != 0 else out.transpose(1, 2)
