"""Statistics of the long-context probe (``benchmarks/probe_long_context.py diagnose``): where a hybrid
layer's normalizer mass goes, what softmax attention would give the same keys, and what its feature
maps see at long positions; and the markdown tables of them."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch

from hybrid_llama.ops.feature_maps import resolve_qk_maps

DIST_EDGES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # distance buckets [e_i, e_i+1)


def positive_log_mean(w: torch.Tensor) -> float:
    """Mean log of the positive entries (queries with no key beyond the window have a zero linear weight)."""
    pos = w[w > 0]
    return float(pos.log().mean()) if pos.numel() else float("nan")


def rope_rotate(x: torch.Tensor, shift: int, theta: float) -> torch.Tensor:
    """Rotate post-RoPE vectors ``[..., D]`` by ``shift`` more positions (Llama's rotate-half layout)."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2).float() / D)
    ang = torch.cat([inv, inv]) * shift
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * torch.cos(ang) + torch.cat([-x2, x1], dim=-1) * torch.sin(ang)


class Collector:
    """Per-layer statistics of the hybrid layers during one forward (``Probe.on_layer``)."""

    def __init__(self, theta: float, train_len: int, shift: int):
        self.theta, self.train_len, self.shift = theta, train_len, shift
        self.rows: list[dict] = []
        self.L, self.tail, self.window_id, self.quadratic = 0, 0, None, False

    def __call__(self, layer, q, k, v, wl, ll, stats):
        H, T = q.shape[1], q.shape[2]
        w_win, w_lin = stats["w_win"], stats["w_lin"]
        share = w_win / (w_win + w_lin)
        base = {"window": self.window_id, "L": self.L, "layer": layer.layer_idx}
        for h in range(H):  # the last `tail` queries (the scored ones)
            sl = slice(T - self.tail, T)
            self.rows.append({**base, "kind": "tail", "head": h, "share": float(share[h, sl].mean()),
                              "log_w_win": positive_log_mean(w_win[h, sl]),
                              "log_w_lin": positive_log_mean(w_lin[h, sl])})
        if not self.quadratic:
            return
        for lo in range(0, T, 512):  # share and the two sums vs position
            sl = slice(lo, lo + 512)
            self.rows.append({**base, "kind": "position", "pos": lo + 256, "share": float(share[:, sl].mean()),
                              "log_w_win": positive_log_mean(w_win[:, sl]),
                              "log_w_lin": positive_log_mean(w_lin[:, sl])})
        self.kernel_vs_softmax(layer, q, k, wl, ll, base)
        self.features(layer, q, k, base)

    def kernel_vs_softmax(self, layer, q, k, wl, ll, base):
        """At sampled queries: the hybrid's linear weight per distance bucket, relative to its window
        weight, against softmax's (the same q, k: ``exp(s_j) / sum_win exp(s)``), in log space."""
        H, T, D = q.shape[1], q.shape[2], q.shape[3]
        g = H // k.shape[1]
        phi_q, phi_k = resolve_qk_maps(layer.op_feature_map())
        kq = k.float().repeat_interleave(g, 1)
        a, b = torch.sigmoid(wl.float()).view(H, 1, 1), torch.sigmoid(ll.float()).view(H, 1, 1)
        for end in (1024, 2048, 4096, 6144, 8192):
            if end > T:
                continue
            pos = torch.arange(end - 16, end)
            qs = q.float()[0][:, pos]  # [H, Q, D]
            s = torch.matmul(qs, kq[0].transpose(-1, -2)) / math.sqrt(D)  # [H, Q, T]
            d = pos[:, None] - torch.arange(T)[None, :]
            win = (d >= 0) & (d < 64)
            lse_win = s.masked_fill(~win, float("-inf")).logsumexp(-1, keepdim=True)
            m_win = s.masked_fill(~win, float("-inf")).amax(-1, keepdim=True)
            fq = phi_q(q.float()[:, :, pos]).float()[0]
            fk = phi_k(k.float()).float().repeat_interleave(g, 1)[0]
            kern = torch.matmul(fq, fk.transpose(-1, -2))  # [H, Q, T]
            # hybrid: b phi(q).phi(k) / (a sum_win e^(s - m)); softmax: e^(s - lse_win)
            hyb = (b * kern).log() - (a.log() + lse_win - m_win)
            soft = s - lse_win
            row = {**base, "kind": "kernel", "query_end": end}
            for lo, hi in zip(DIST_EDGES[:-1], DIST_EDGES[1:]):
                sel = (d >= lo) & (d < hi)
                if not bool(sel.any()):
                    continue
                lh = hyb.masked_fill(~sel, float("-inf")).logsumexp(-1)  # [H, Q]: the bucket's mass
                ls = soft.masked_fill(~sel, float("-inf")).logsumexp(-1)
                row[f"hyb_{lo}"], row[f"soft_{lo}"] = float(lh.mean()), float(ls.mean())
            lin = d >= 64
            sink = d.new_zeros(d.shape, dtype=torch.bool)
            sink[:, :4] = True
            row["hyb_all"] = float(hyb.masked_fill(~lin, float("-inf")).logsumexp(-1).mean())
            row["soft_all"] = float(soft.masked_fill(~lin, float("-inf")).logsumexp(-1).mean())
            row["soft_nosink"] = float(soft.masked_fill(~lin | sink, float("-inf")).logsumexp(-1).mean())
            # the same tokens RoPE'd `shift` positions later: softmax is unchanged, the kernel is not
            fq2 = phi_q(rope_rotate(q.float()[:, :, pos], self.shift, self.theta)).float()[0]
            fk2 = phi_k(rope_rotate(k.float(), self.shift, self.theta)).float().repeat_interleave(g, 1)[0]
            kern2 = torch.matmul(fq2, fk2.transpose(-1, -2))
            den1 = (kern * lin).sum(-1)
            den2 = (kern2 * lin).sum(-1)
            row["shift_log_den_ratio"] = float((den2 / den1).log().mean())
            self.rows.append(row)

    def features(self, layer, q, k, base):
        """Feature-map inputs and outputs by key position: energy in RoPE pairs whose wavelength exceeds
        the training length (rotations training never completed) and the entropy of phi(k)."""
        D = q.shape[-1]
        inv = self.theta ** (-torch.arange(0, D, 2).float() / D)
        slow = (2 * math.pi / inv) > self.train_len
        slow_dims = torch.cat([slow, slow])
        phi_q, phi_k = resolve_qk_maps(layer.op_feature_map())
        fk = phi_k(k.float()).float()[0]  # [Hk, T, F]
        half = fk.shape[-1] // 2
        ent = sum(-(x * x.clamp_min(1e-30).log()).sum(-1) for x in (fk[..., :half], fk[..., half:])) / 2
        T = q.shape[2]
        for lo, hi in ((0, 2048), (2048, 4096), (4096, 8192)):
            if lo >= T:
                continue
            sl = slice(lo, min(hi, T))
            qk = torch.cat([q.float()[0][:, sl].reshape(-1, D), k.float()[0][:, sl].reshape(-1, D)])
            energy = float((qk[:, slow_dims] ** 2).sum() / (qk**2).sum())
            self.rows.append({**base, "kind": "features", "pos_lo": lo, "slow_pairs": int(slow.sum()),
                              "slow_energy": energy, "phi_k_entropy": float(ent[:, sl].mean()),
                              "phi_k_max": float(fk[:, sl].max(-1).values.mean())})


def report_diagnosis(rows: list[dict], md: Path) -> None:
    """Tables averaged over windows (and heads, queries): the shares, the sums, the kernel's excess."""
    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else float("nan")

    lines = ["## Window share of the normalizer over the last scored queries (mean over heads, windows)", ""]
    tail = [r for r in rows if r["kind"] == "tail"]
    Ls = sorted({r["L"] for r in tail})
    layers = sorted({r["layer"] for r in tail})
    lines += ["| layer | " + " | ".join(f"share at {L}" for L in Ls) + " | min head share at " + str(Ls[-1])
              + " |", "|---|" + "---|" * (len(Ls) + 1)]
    for layer in layers:
        cells = [f"{mean(r['share'] for r in tail if r['layer'] == layer and r['L'] == L):.3f}" for L in Ls]
        heads = defaultdict(list)
        for r in tail:
            if r["layer"] == layer and r["L"] == Ls[-1]:
                heads[r["head"]].append(r["share"])
        cells.append(f"{min(mean(v) for v in heads.values()):.3f}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    pos = [r for r in rows if r["kind"] == "position"]
    ps = sorted({r["pos"] for r in pos})
    pick = [p for p in ps if p in (256, 768, 1792, 2304, 3840, 5888, 7936)] or ps
    lines += ["", "## log a·sum_win exp(s - m) and log b·phi(q)·z vs position (mean over layers, heads)", "",
              "| position | window share | log window weight | log linear weight |", "|---|---|---|---|"]
    for p in pick:
        sel = [r for r in pos if r["pos"] == p]
        lines.append(f"| {p} | {mean(r['share'] for r in sel):.3f} | {mean(r['log_w_win'] for r in sel):.2f} | "
                     f"{mean(r['log_w_lin'] for r in sel):.2f} |")
    ker = [r for r in rows if r["kind"] == "kernel"]
    ends = sorted({r["query_end"] for r in ker})
    lines += ["", "## Mass beyond the window relative to the window's (natural log; mean over layers, heads, "
              "queries): hybrid linear part vs softmax on the same q, k", "",
              "| queries ending at | " + " | ".join(f"[{lo},{hi})" for lo, hi in zip(DIST_EDGES[:-1], DIST_EDGES[1:]))
              + " | all: hybrid | all: softmax | softmax w/o 4 first keys | kernel drift, log den shift |",
              "|---|" + "---|" * (len(DIST_EDGES) + 3)]
    for e in ends:
        sel = [r for r in ker if r["query_end"] == e]
        cells = []
        for lo in DIST_EDGES[:-1]:
            hs = [r[f"hyb_{lo}"] for r in sel if f"hyb_{lo}" in r]
            ss = [r[f"soft_{lo}"] for r in sel if f"soft_{lo}" in r]
            cells.append(f"{mean(hs):.2f} / {mean(ss):.2f}" if hs else "")
        cells += [f"{mean(r['hyb_all'] for r in sel):.2f}", f"{mean(r['soft_all'] for r in sel):.2f}",
                  f"{mean(r['soft_nosink'] for r in sel):.2f}", f"{mean(r['shift_log_den_ratio'] for r in sel):+.3f}"]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    feat = [r for r in rows if r["kind"] == "features"]
    lines += ["", "## Feature-map inputs by position (mean over layers, windows)", "",
              "| key positions | q,k energy in RoPE pairs slower than the training length | phi(k) entropy | "
              "phi(k) max |", "|---|---|---|---|"]
    for lo in sorted({r["pos_lo"] for r in feat}):
        sel = [r for r in feat if r["pos_lo"] == lo]
        lines.append(f"| {lo}+ ({sel[0]['slow_pairs']} of 32 pairs) | {mean(r['slow_energy'] for r in sel):.3f} | "
                     f"{mean(r['phi_k_entropy'] for r in sel):.3f} | {mean(r['phi_k_max'] for r in sel):.3f} |")
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
