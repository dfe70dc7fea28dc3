"""How the sparse cache picks its keys: the scores of the candidates and one block's close (keep the
best, fold the rest into the linear state). Every path (reference, torch, native, decode) closes a
block with these functions, so they all keep the same keys."""

from __future__ import annotations

import torch
from torch import Tensor

SRE_EPS = 1e-6


def random_scores(pos: Tensor, kv_heads: int) -> Tensor:
    """A fixed pseudo-random score in [0, 1) per (position, KV head): ``pos`` ``[B, Hk, N]`` int64.
    Integer hashing, so the prefill and the decode step draw the same value for a key."""
    head = torch.arange(kv_heads, device=pos.device).view(1, -1, 1)
    h = (pos * 0x9E3779B1 + (head + 1) * 0x85EBCA77) & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    h = h ^ (h >> 12)
    return h.to(torch.float64).div(2.0**32).float()


def candidate_scores(
    rule: str, k: Tensor, v: Tensor, pos: Tensor, acc: Tensor | None, S: Tensor, z: Tensor, phi_k,
    fk: Tensor | None = None,
) -> Tensor:
    """Scores ``[B, Hk, N]`` of candidates k/v ``[B, Hk, N, D]`` at positions ``pos``: higher stays.
    ``fk``: ``phi_k(k)`` where the caller has it."""
    if rule == "sre":
        fk = phi_k(k.float()) if fk is None else fk  # [B, Hk, N, F]
        recall = torch.matmul(fk, S) / (torch.matmul(fk, z.unsqueeze(-1)) + SRE_EPS)
        return (v.float() - recall).norm(dim=-1)
    if rule == "random":
        return random_scores(pos, k.shape[1])
    return acc


def close_block(
    rule: str,
    cand_k: Tensor,
    cand_v: Tensor,
    cand_valid: Tensor,
    cand_pos: Tensor,
    cand_acc: Tensor | None,
    S: Tensor,
    z: Tensor,
    size: int,
    phi_k,
    fold_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One eviction: keep the ``size`` best candidates (ties: the earlier position), fold the others.

    Candidates ``[B, Hk, N, ...]`` come in position order with empty/padding slots invalid. Returns
    (index of the kept candidates in position order ``[B, Hk, size]``, their validity, S', z').
    ``fold_weight`` ``[B|1, Hk, N]``: what a folded candidate enters S, z with (a decaying state's
    ``fold_weights``); the scores read S, z as given."""
    fk = phi_k(cand_k.float())  # the score's (sre) and the fold's: one feature map per candidate
    with torch.no_grad():
        score = candidate_scores(rule, cand_k, cand_v, cand_pos, cand_acc, S, z, phi_k, fk.detach())
        score = score.masked_fill(~cand_valid, float("-inf"))
        best = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :size]
        kept_pos = cand_pos.gather(-1, best).masked_fill(~cand_valid.gather(-1, best), torch.iinfo(torch.long).max)
        keep = best.gather(-1, kept_pos.argsort(dim=-1, stable=True))
    fold = folded_candidates(cand_valid, keep).unsqueeze(-1)
    fk = fk * fold if fold_weight is None else fk * (fold * fold_weight.unsqueeze(-1))
    S = S + torch.matmul(fk.transpose(-1, -2), cand_v.float())
    z = z + fk.sum(dim=2)
    return keep, cand_valid.gather(-1, keep), S, z


def fold_weights(log_decay: Tensor | None, close_t: int, window: int, pos: Tensor) -> Tensor | None:
    """gamma^(close_t - w - p) ``[1|B, Hk, N]`` for keys at positions ``pos`` ``[..., Hk, N]`` folded by
    the close at position ``close_t``: their weight in a decaying state as of that position (the
    age since each left the window; empty slots clamp to age 0). None without a decay."""
    if log_decay is None:
        return None
    age = (close_t - window - pos).clamp(min=0).float()
    return torch.exp(log_decay.float().view(-1, 1) * age)


def folded_candidates(cand_valid: Tensor, keep: Tensor) -> Tensor:
    """The candidates a close folds into ``S, z``: the valid ones ``keep`` (``close_block``'s) leaves out."""
    return cand_valid & ~torch.zeros_like(cand_valid).scatter_(-1, keep, True)


def gather_slots(x: Tensor, index: Tensor) -> Tensor:
    """``x`` ``[B, Hk, N, D]`` at ``index`` ``[B, Hk, M]`` -> ``[B, Hk, M, D]``."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def group_bounds(T: int, window: int, sinks: int) -> list[tuple[int, int]]:
    """Query ranges [t0, t1) that see the same number J of closed blocks: group J ends where block J
    closes, at t = sinks + (J + 2) w - 1 (its last key leaves the window)."""
    bounds, t0, J = [], 0, 0
    while t0 < T:
        t1 = min(T, sinks + (J + 2) * window - 1)
        if t1 > t0:
            bounds.append((t0, t1))
        t0, J = max(t0, t1), J + 1
    return bounds
