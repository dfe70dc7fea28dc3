"""The native CPU decode step (ops/cpu_kernels.c, ops/cpu_step.py): equal to the torch step and to the
naive parallel op, built once per source and CPU, and never in the way where it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch
from op_inputs import count_calls, trained_maps

from hybrid_llama.ops import SparseCacheConfig, hybrid_attention, hybrid_attention_step, init_state
from hybrid_llama.ops.feature_maps import resolve_qk_maps
from hybrid_llama.ops.native import build as native
from hybrid_llama.ops.native import step as cpu_step
from hybrid_llama.ops.state import HybridState, prefill_state

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no C compiler here: {native.why_not()}")


def problem(B, H, Hk, T, D, fmap, seed=5):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    wl, ll = 2 * torch.randn(H, generator=g), 2 * torch.randn(H, generator=g)
    feature = trained_maps(H, Hk, D) if fmap == "hedgehog" else "elu1"
    return q, k, v, wl, ll, feature, (2 * D if fmap == "hedgehog" else D)


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the steps the kernel ran (step_in_place returning an output) and declined."""
    return count_calls(monkeypatch, cpu_step, "step_in_place")


def steps(q, k, v, wl, ll, state, **kw):
    outs = []
    for t in range(q.shape[2]):
        o, state = hybrid_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, wl, ll,
                                         inplace=True, **kw)
        outs.append(o)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("B,H,Hk,D,w", [(2, 4, 2, 8, 6), (1, 9, 3, 64, 16), (1, 3, 3, 16, 1)])
def test_native_step_equals_torch_step_and_naive_op(formulation, fmap, B, H, Hk, D, w, native_calls):
    """Across the window's fill, the first fold and many folds, with GQA and a batch: the kernel's
    outputs and states equal the torch in-place step's, and its outputs the naive O(T^2) op's."""
    T = 3 * w + 7
    q, k, v, wl, ll, feature, fdim = problem(B, H, Hk, T, D, fmap)
    kw = dict(feature_map=feature, formulation=formulation)
    with torch.no_grad():
        got, native = steps(q, k, v, wl, ll, init_state(B, Hk, D, w, feature_dim=fdim), backend="auto", **kw)
        assert native_calls == {"ran": T, "declined": 0}
        want, torch_state = steps(q, k, v, wl, ll, init_state(B, Hk, D, w, feature_dim=fdim), backend="torch", **kw)
        naive, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, naive, atol=2e-6, rtol=1e-5)
    assert native.seen == torch_state.seen == T
    assert torch.equal(native.k_window, torch_state.k_window) and torch.equal(native.v_window, torch_state.v_window)
    assert torch.equal(native.window_valid, torch_state.window_valid)
    torch.testing.assert_close(native.S, torch_state.S, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.z, torch_state.z, atol=1e-5, rtol=1e-5)


def decays(Hk: int) -> torch.Tensor:
    """log gamma per KV head, from a long memory (gamma 0.98) to a short one (0.5)."""
    return torch.linspace(-0.02, -0.7, Hk)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("B,H,Hk,D,w", [(2, 4, 2, 8, 6), (1, 9, 3, 64, 16), (1, 3, 3, 16, 1)])
def test_native_step_with_a_decay_equals_torch_step_and_naive_op(formulation, fmap, B, H, Hk, D, w, native_calls):
    """A decaying linear state: the kernel scales S and z by gamma before each fold, so its outputs and
    states equal the torch step's with the same decay, and its outputs the reference op's over the
    sequence; every step ran natively."""
    T = 3 * w + 7
    q, k, v, wl, ll, feature, fdim = problem(B, H, Hk, T, D, fmap)
    log_decay = decays(Hk)
    kw = dict(feature_map=feature, formulation=formulation, log_decay=log_decay)
    with torch.no_grad():
        got, native = steps(q, k, v, wl, ll, init_state(B, Hk, D, w, feature_dim=fdim), backend="auto", **kw)
        assert native_calls == {"ran": T, "declined": 0}
        want, torch_state = steps(q, k, v, wl, ll, init_state(B, Hk, D, w, feature_dim=fdim), backend="torch", **kw)
        naive, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)
        undecayed, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", feature_map=feature,
                                        formulation=formulation)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, naive, atol=2e-6, rtol=1e-5)
    if formulation != "window":
        assert (got - undecayed).abs().max() > 1e-3  # the decay is felt
    torch.testing.assert_close(native.S, torch_state.S, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.z, torch_state.z, atol=1e-5, rtol=1e-5)
    assert torch.equal(native.k_window, torch_state.k_window) and native.seen == torch_state.seen == T


def test_native_step_with_a_decay_continues_a_prefill_and_follows_the_decay(native_calls):
    """From a native prefill's decayed state: the steps equal the reference op over the whole
    sequence; a decay changed in place is read at the next step (the kernel reads it where it is), a
    new tensor prepares the call again, and a decay the kernel cannot read (fp64, or one per query
    head) is declined before anything is written."""
    B, H, Hk, D, w, T, n = 1, 6, 2, 64, 8, 150, 12
    q, k, v, wl, ll, feature, _ = problem(B, H, Hk, T + n, D, "hedgehog", seed=9)
    log_decay = decays(Hk)
    kw = dict(feature_map=feature, formulation="lolcats")
    with torch.no_grad():
        _, state = hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w, backend="auto",
                                    output_final_state=True, log_decay=log_decay, **kw)
        first, state = steps(q[:, :, T : T + 4], k[:, :, T : T + 4], v[:, :, T : T + 4], wl, ll, state,
                             log_decay=log_decay, **kw)
        naive, _ = hybrid_attention(q[:, :, : T + 4], k[:, :, : T + 4], v[:, :, : T + 4], wl, ll, window=w,
                                    backend="reference", log_decay=log_decay, **kw)
        torch.testing.assert_close(first, naive[:, :, T:], atol=2e-6, rtol=1e-5)
        assert native_calls == {"ran": 4, "declined": 0}

        t = T + 4
        one = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        held = {name: getattr(state, name).clone() for name in ("k_window", "S", "z")}
        for wrong in (log_decay.double(), torch.full((H,), -0.1)):
            assert cpu_step.step_in_place(*one, state, wl, ll, "lolcats", *feature, log_decay=wrong) is None
        assert state.seen == t and all(torch.equal(getattr(state, name), held[name]) for name in held)

        mirror = copy_state(state)  # the torch step's, fed the same decays
        changed = log_decay.clone()
        for t in range(T + 4, T + n):
            one = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            if t == T + 6:
                changed.mul_(3.0)  # in place: the prepared call reads the new values
            if t == T + 9:
                changed = torch.full((Hk,), -0.05)  # a new tensor: the call is prepared again
            got, state = hybrid_attention_step(*one, state, wl, ll, inplace=True, log_decay=changed, **kw)
            want, mirror = hybrid_attention_step(*one, mirror, wl, ll, backend="torch", log_decay=changed, **kw)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=f"step {t}")
    assert native_calls == {"ran": n, "declined": 2}
    torch.testing.assert_close(state.S, mirror.S, atol=1e-5, rtol=1e-5)


def copy_state(state: HybridState) -> HybridState:
    """A copy of a plain state's buffers (the prepared native call stays with the original)."""
    return HybridState(*(getattr(state, name).clone() for name in ("k_window", "v_window", "window_valid", "S", "z")),
                       state.seen)


@pytest.mark.parametrize("rows_apart", [False, True])
def test_native_step_applies_llamas_rope_itself(rows_apart):
    """Given q and k before RoPE and the token's (cos, sin) from transformers' Llama rotary embedding
    (one position for the batch, or one per row), the kernel's outputs and ring equal the step on q and
    k rotated by transformers' apply_rotary_pos_emb, and the general step's on them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, H, Hk, D, w, T = 2, 6, 2, 16, 4, 11
    q, k, v, wl, ll, feature, fdim = problem(B, H, Hk, T, D, "hedgehog", seed=13)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H * D, num_attention_heads=H, rope_theta=500.0))
    start = torch.tensor([[3], [40]]) if rows_apart else torch.tensor([[7]])
    fused, rotated, general = (init_state(B, Hk, D, w, feature_dim=fdim) for _ in range(3))
    with torch.no_grad():
        for t in range(T):
            cos, sin = rotary(v[:, :1, t], start + t)  # [1 | B, 1, D]
            qt, kt, vt = q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]
            qr, kr = apply_rotary_pos_emb(qt, kt, cos, sin)
            assert not torch.allclose(qr, qt)  # the rotation is not the identity at these positions
            got = cpu_step.step_in_place(qt, kt, vt, fused, wl, ll, "lolcats", *feature, rope=(cos, sin))
            want = cpu_step.step_in_place(qr, kr, vt, rotated, wl, ll, "lolcats", *feature)
            torch_out, general = hybrid_attention_step(qr, kr, vt, general, wl, ll, feature_map=feature,
                                                       formulation="lolcats", backend="torch")
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got, torch_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(fused.k_window, rotated.k_window, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused.k_window, general.k_window, atol=1e-6, rtol=1e-5)
    assert torch.equal(fused.v_window, rotated.v_window)
    torch.testing.assert_close(fused.S, general.S, atol=1e-5, rtol=1e-5)


def test_native_sparse_step_applies_llamas_rope_itself(native_sparse_calls):
    """With a sparse cache, through sinks filling and closed blocks: given q and k before RoPE and the
    token's (cos, sin) per batch row, the kernel's outputs equal the torch sparse step's on q and k
    rotated by transformers' apply_rotary_pos_emb (the block-closing steps, which the kernel declines,
    rotated and stepped in torch as a layer does), and so does every buffer of the state."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, H, Hk, D, w, T, size, sinks = 2, 6, 2, 16, 4, 3, 5, 2
    n = 4 * w + sinks + 2
    q, k, v, wl, ll, feature, _ = problem(B, H, Hk, T + n, D, "hedgehog", seed=17)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H * D, num_attention_heads=H, rope_theta=500.0))
    kw = dict(feature_map=feature, formulation="lolcats", sparse=SparseCacheConfig(size, sinks))
    positions = torch.tensor([[5], [60]])
    with torch.no_grad():
        cos, sin = rotary(v[:, :1, :T], positions + torch.arange(T))
        qr, kr = apply_rotary_pos_emb(q[:, :, :T], k[:, :, :T], cos, sin)
        fused, rotated = (hybrid_attention(qr, kr, v[:, :, :T], wl, ll, window=w, backend="chunked",
                                           output_final_state=True, **kw)[1] for _ in range(2))
        maps = resolve_qk_maps(feature)[0]
        declined = 0
        for t in range(T, T + n):
            cos, sin = rotary(v[:, :1, t], positions + t)  # [B, 1, D]
            qt, kt, vt = q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]
            qr, kr = apply_rotary_pos_emb(qt, kt, cos, sin)
            got = cpu_step.sparse_step_in_place(qt, kt, vt, fused, wl, ll, maps, kw["sparse"], rope=(cos, sin))
            if got is None:  # a block closes: the layer rotates and takes the general step
                declined += 1
                got, fused = hybrid_attention_step(qr, kr, vt, fused, wl, ll, inplace=True, **kw)
            want, rotated = hybrid_attention_step(qr, kr, vt, rotated, wl, ll, inplace=True, backend="torch", **kw)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # each closing step declined twice: asked directly, then by the general step before its torch path
    assert declined >= 3 and native_sparse_calls == {"ran": n - declined, "declined": 2 * declined}
    for name, want_t in _state_fields(rotated).items():
        torch.testing.assert_close(_state_fields(fused)[name], want_t, atol=1e-5, rtol=1e-5, msg=name)


def test_native_step_declines_rope_tables_it_cannot_read(native_calls):
    """Tables of another width or dtype are declined before anything is written; the caller then rotates."""
    B, H, Hk, D, w = 1, 4, 2, 8, 4
    q, k, v, wl, ll, _, _ = problem(B, H, Hk, 1, D, "elu1")
    state = init_state(B, Hk, D, w)
    with torch.no_grad():
        for cos in (torch.ones(1, 1, D // 2), torch.ones(1, 1, D, dtype=torch.float64), torch.ones(3, 1, D)):
            assert cpu_step.step_in_place(q, k, v, state, wl, ll, "lolcats", cpu_step.elu1, cpu_step.elu1,
                                          rope=(cos, torch.zeros_like(cos))) is None
    assert state.seen == 0 and not state.window_valid.any()


def test_native_step_is_the_same_on_any_number_of_threads(native_calls):
    """The kernel splits a step's KV heads, then its query heads, over torch's threads: one, two and
    three threads (more than there are KV heads per batch row) give bit-identical outputs and states."""
    B, H, Hk, D, w = 2, 9, 3, 16, 4
    T = 3 * w + 1
    q, k, v, wl, ll, feature, fdim = problem(B, H, Hk, T, D, "hedgehog")
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.no_grad():
                runs.append(steps(q, k, v, wl, ll, init_state(B, Hk, D, w, feature_dim=fdim),
                                  feature_map=feature, formulation="lolcats"))
    finally:
        torch.set_num_threads(threads)
    assert native_calls == {"ran": 3 * T, "declined": 0}
    (out, state), others = runs[0], runs[1:]
    for other, other_state in others:
        assert torch.equal(out, other)
        assert all(torch.equal(getattr(state, f), getattr(other_state, f)) for f in ("k_window", "v_window", "S", "z"))


def test_native_step_continues_a_prefill_and_follows_new_logits(native_calls):
    """From a chunked prefill's state, with the mixing logits changed in place mid-way (as an optimizer
    step does), the kernel's steps equal the naive op over the whole sequence."""
    B, H, Hk, D, w, T, n = 1, 6, 2, 32, 8, 29, 12
    q, k, v, wl, ll, feature, _ = problem(B, H, Hk, T + n, D, "hedgehog", seed=9)
    kw = dict(feature_map=feature, formulation="lolcats")
    with torch.no_grad():
        _, state = hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w, backend="chunked",
                                    output_final_state=True, **kw)
        first, state = steps(q[:, :, T : T + 5], k[:, :, T : T + 5], v[:, :, T : T + 5], wl, ll, state, **kw)
        naive, _ = hybrid_attention(q[:, :, : T + 5], k[:, :, : T + 5], v[:, :, : T + 5], wl, ll, window=w,
                                    backend="reference", **kw)
        torch.testing.assert_close(first, naive[:, :, T:], atol=2e-6, rtol=1e-5)
        wl.add_(torch.linspace(-3, 3, H))
        ll.mul_(-1)
        rest, state = steps(q[:, :, T + 5 :], k[:, :, T + 5 :], v[:, :, T + 5 :], wl, ll, state, **kw)
        naive, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)
    torch.testing.assert_close(rest, naive[:, :, T + 5 :], atol=2e-6, rtol=1e-5)
    assert native_calls["ran"] == n and state.seen == T + n


def test_prepared_step_follows_whatever_it_was_bound_to(native_calls):
    """The kernel's call is prepared once per state and re-checked every step: a state buffer rebound
    to a copy, a map's parameter replaced, a parameter moved by ``.data =``, a map module swapped and
    new logits each take effect on the next step (outputs equal the torch step's with the same
    inputs), and the kernel never writes the buffer it was bound to before."""
    B, H, Hk, D, w, T = 1, 4, 2, 8, 4, 14
    q, k, v, wl, ll, (qmap, kmap), fdim = problem(B, H, Hk, T, D, "hedgehog")
    fast, slow = init_state(B, Hk, D, w, feature_dim=fdim), init_state(B, Hk, D, w, feature_dim=fdim)
    left_behind = {}

    def change(t):
        nonlocal qmap, wl
        if t == 3:
            left_behind["S"] = fast.S
            fast.S = fast.S.clone()
            left_behind["S before"] = left_behind["S"].clone()
        elif t == 5:
            qmap.weight = torch.nn.Parameter(1.5 * qmap.weight.detach())
        elif t == 7:
            kmap.bias.data = kmap.bias.detach() + 0.3
        elif t == 9:
            qmap = trained_maps(H, Hk, D, seed=11)[0]
        elif t == 11:
            wl = wl + 1.0

    with torch.no_grad():
        for t in range(T):
            change(t)
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            kw = dict(feature_map=(qmap, kmap), formulation="lolcats")
            got, fast = hybrid_attention_step(*step, fast, wl, ll, inplace=True, **kw)
            want, slow = hybrid_attention_step(*step, slow, wl, ll, backend="torch", **kw)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=f"step {t}")
    assert native_calls == {"ran": T, "declined": 0}
    torch.testing.assert_close(fast.S, slow.S, atol=1e-5, rtol=1e-5)
    assert torch.equal(left_behind["S"], left_behind["S before"])


def test_torch_step_where_the_kernel_does_not_apply(native_calls, monkeypatch):
    """A padded key in the window, bf16 buffers, the torch backend and HYBRID_LLAMA_NATIVE=0 all
    take the torch step, with its results."""
    B, H, Hk, D, w, T = 2, 4, 2, 8, 4, 7
    q, k, v, wl, ll, feature, fdim = problem(B, H, Hk, T + 3, D, "elu1")
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, T - 1] = False
    with torch.no_grad():
        padded = prefill_state(k[:, :, :T], v[:, :, :T], window=w, key_padding_mask=mask)
        reference = prefill_state(k[:, :, :T], v[:, :, :T], window=w, key_padding_mask=mask)
        step = (q[:, :, T : T + 1], k[:, :, T : T + 1], v[:, :, T : T + 1])
        got, _ = hybrid_attention_step(*step, padded, wl, ll, formulation="lolcats", inplace=True)
        want, _ = hybrid_attention_step(*step, reference, wl, ll, formulation="lolcats", backend="torch")
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert native_calls["ran"] == 0  # the padded key kept it from being asked at all

        half = prefill_state(k[:, :, :T].bfloat16(), v[:, :, :T].bfloat16(), window=w)
        hybrid_attention_step(*(t.bfloat16() for t in step), half, wl, ll, formulation="lolcats", inplace=True)
        assert native_calls == {"ran": 0, "declined": 1}

        clean = prefill_state(k[:, :, :T], v[:, :, :T], window=w)
        hybrid_attention_step(*step, clean, wl, ll, formulation="lolcats", inplace=True, backend="torch")
        monkeypatch.setenv("HYBRID_LLAMA_NATIVE", "0")
        hybrid_attention_step(*step, clean, wl, ll, formulation="lolcats", inplace=True)
        assert native_calls == {"ran": 0, "declined": 2}


@pytest.fixture
def native_sparse_calls(monkeypatch):
    """Counts the sparse steps the kernel ran and those it left to the torch step."""
    return count_calls(monkeypatch, cpu_step, "sparse_step_in_place")


def _state_fields(state):
    sparse = {f"sparse.{name}": getattr(state.sparse, name) for name in vars(state.sparse)}
    own = {name: getattr(state, name) for name in ("k_window", "v_window", "window_valid", "S", "z")}
    return {**own, **sparse}


@pytest.mark.parametrize("score", ["sre", "random"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("B,H,Hk,D,w,size,sinks,T", [(2, 4, 2, 8, 6, 5, 2, 9), (1, 9, 3, 64, 8, 12, 4, 3),
                                                    (1, 3, 3, 16, 4, 0, 1, 17)])
def test_native_sparse_step_equals_torch_step_and_naive_op(score, fmap, B, H, Hk, D, w, size, sinks, T,
                                                           native_sparse_calls):
    """From a prefill (inside or past the window), through sinks filling, many closed blocks and
    evictions: the kernel's outputs and states equal the torch sparse step's, and its outputs the
    naive O(T^2) sparse op's; it runs every step but the one in w that closes a block."""
    n = 5 * w + sinks + 3
    q, k, v, wl, ll, feature, _ = problem(B, H, Hk, T + n, D, fmap, seed=11)
    kw = dict(feature_map=feature, formulation="lolcats", sparse=SparseCacheConfig(size, sinks, score))
    head = (q[:, :, :T], k[:, :, :T], v[:, :, :T])
    tail = (q[:, :, T:], k[:, :, T:], v[:, :, T:])
    with torch.no_grad():
        _, start = hybrid_attention(*head, wl, ll, window=w, backend="chunked", output_final_state=True, **kw)
        _, again = hybrid_attention(*head, wl, ll, window=w, backend="chunked", output_final_state=True, **kw)
        got, native = steps(*tail, wl, ll, start, backend="auto", **kw)
        closing = sum(1 for t in range(T, T + n) if t - w >= sinks and (t - w - sinks) % w == w - 1)
        assert native_sparse_calls == {"ran": n - closing, "declined": closing} and closing >= 4
        want, reference = steps(*tail, wl, ll, again, backend="torch", **kw)
        naive, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, naive[:, :, T:], atol=2e-6, rtol=1e-5)
    assert native.seen == reference.seen == T + n
    got_fields, want_fields = _state_fields(native), _state_fields(reference)
    for name, want_t in want_fields.items():
        torch.testing.assert_close(got_fields[name], want_t, atol=1e-5, rtol=1e-5, msg=name)


def test_native_sparse_step_leaves_the_prefill_tensors_alone(native_sparse_calls):
    """The step writes in place, but only into memory of the state's own: a state whose buffers are
    shared with another (a copy that still reads them) leaves that one as it was."""
    B, H, Hk, D, w, T = 1, 4, 2, 8, 4, 11
    q, k, v, wl, ll, feature, _ = problem(B, H, Hk, T + 3, D, "elu1")
    kw = dict(formulation="lolcats", sparse=SparseCacheConfig(3, 1))
    with torch.no_grad():
        _, state = hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w, backend="chunked",
                                    output_final_state=True, **kw)
        shared = {name: t.clone() for name, t in _state_fields(state).items()}
        alias = _state_fields(state)
        steps(q[:, :, T:], k[:, :, T:], v[:, :, T:], wl, ll, state, **kw)
        assert native_sparse_calls["ran"] >= 2
    for name, before in shared.items():
        assert torch.equal(alias[name], before), name


def test_torch_sparse_step_where_the_kernel_does_not_apply(native_sparse_calls):
    """The ``attention`` score (its sums change every step) and a padded new key are never offered to
    the kernel; bf16 buffers and a sparse buffer of the wrong size are declined, the state untouched."""
    B, H, Hk, D, w, T = 2, 4, 2, 8, 4, 9
    q, k, v, wl, ll, feature, _ = problem(B, H, Hk, T + 2, D, "elu1")
    step = (q[:, :, T : T + 1], k[:, :, T : T + 1], v[:, :, T : T + 1])
    kw = dict(formulation="lolcats", sparse=SparseCacheConfig(3, 1))

    def prefill(**settings):
        return hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w, backend="chunked",
                                output_final_state=True, **(settings or kw))[1]

    with torch.no_grad():
        attention = dict(kw, sparse=SparseCacheConfig(3, 1, "attention"))
        hybrid_attention_step(*step, prefill(**attention), wl, ll, inplace=True, **attention)
        hybrid_attention_step(*step, prefill(), wl, ll, inplace=True, key_valid=torch.tensor([True, False]), **kw)
        assert native_sparse_calls == {"ran": 0, "declined": 0}

        half = prefill().to(dtype=torch.bfloat16)
        broken = prefill()
        broken.sparse.pend_k = broken.sparse.pend_k[:, :, :-1]
        for state in (half, broken):
            held = _state_fields(state)
            assert cpu_step.sparse_step_in_place(*step, state, wl, ll, cpu_step.elu1, kw["sparse"]) is None
            assert state.seen == T and all(_state_fields(state)[name] is t for name, t in held.items())


def test_kernel_checks_every_buffer_shape():
    """The kernel trusts its sizes: a state whose buffers disagree with q/k/v is declined, not read."""
    B, H, Hk, D, w = 1, 4, 2, 8, 4
    q, k, v, wl, ll, _, _ = problem(B, H, Hk, 1, D, "elu1")
    with torch.no_grad():
        for broken in ("S", "z", "v_window", "window_valid"):
            state = init_state(B, Hk, D, w)
            t = getattr(state, broken)
            setattr(state, broken, t[..., :-1].contiguous() if broken != "window_valid" else t[:, :-1].contiguous())
            assert cpu_step.step_in_place(q, k, v, state, wl, ll, "lolcats", *(cpu_step.elu1,) * 2) is None
            assert state.seen == 0
        assert cpu_step.step_in_place(q, k, v, init_state(B, Hk, D, w), wl[:-1], ll, "lolcats",
                                      cpu_step.elu1, cpu_step.elu1) is None


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    """The first use compiles into the cache directory; a fresh process state reuses that file without
    compiling."""
    monkeypatch.setenv("HYBRID_LLAMA_KERNEL_CACHE", str(tmp_path))
    for name in ("_library", "_why_not", "built_with"):
        monkeypatch.setattr(native, name, None)
    lib = native.load()
    assert lib is not None and native.library_path().parent == tmp_path
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert built == [native.library_path()]
    mtime = built[0].stat().st_mtime_ns

    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_compile", lambda *args: pytest.fail("compiled again"))
    assert native.load() is not None and built[0].stat().st_mtime_ns == mtime





def test_generation_with_the_kernel_equals_the_torch_step(tmp_path):
    """A hybrid model's cached greedy generation is the same with the kernel and with the torch step."""
    from hybrid_llama.models import convert_to_hybrid, load_model
    from hybrid_llama.weights import resolve_model

    model, _ = load_model(resolve_model({"kind": "random", "preset": "tiny"}, str(tmp_path / "tiny")))
    convert_to_hybrid(model, layers=[0, 1], window=4, formulation="lolcats", feature_map="hedgehog")
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    runs = {}
    for flag in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HYBRID_LLAMA_NATIVE", flag)
            runs[flag] = model.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True)
    assert torch.equal(runs["1"].sequences, runs["0"].sequences)
    torch.testing.assert_close(torch.stack(runs["1"].logits), torch.stack(runs["0"].logits), atol=1e-4, rtol=1e-4)


def test_generate_steps_take_the_native_call_without_the_general_step(tmp_path, monkeypatch, native_calls):
    """An unmasked one-token step of a hybrid layer goes straight to the native call (the general
    step's dispatch is not entered) and cached generation still equals recomputing every step; a
    padded batch's steps carry a mask and take the general step."""
    from hybrid_llama.eval.throughput import greedy_decode
    from hybrid_llama.layers import hybrid_attention as layer_module
    from hybrid_llama.models import convert_to_hybrid, load_model
    from hybrid_llama.weights import resolve_model

    model, _ = load_model(resolve_model({"kind": "random", "preset": "tiny"}, str(tmp_path / "tiny")))
    convert_to_hybrid(model, layers=[0, 1], window=4, formulation="lolcats", feature_map="hedgehog")
    model.eval()
    general = count_calls(monkeypatch, layer_module, "hybrid_attention_step")
    rotated_natively = count_calls(monkeypatch, cpu_step, "_rope_pointers")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(greedy_decode(model, ids, 10), greedy_decode(model, ids, 10, use_cache=False))
    assert general == {"ran": 0, "declined": 0} and native_calls == {"ran": 10 * 2, "declined": 0}
    assert rotated_natively == {"ran": 10 * 2, "declined": 0}  # q and k went in before RoPE
    padded = torch.cat([ids, ids[:, :5].flip(1)], dim=1).reshape(2, 7)
    mask = torch.ones_like(padded)
    mask[1, :2] = 0
    model.generate(input_ids=padded, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert general["ran"] > 0  # the mask's steps


def test_sparse_generate_steps_rotate_in_the_native_call(tmp_path, monkeypatch, native_sparse_calls):
    """With a sparse cache and an exact KV head, an unmasked one-token step also goes straight to the
    native call with q and k before RoPE; only the steps that close a block (one in w) take the general
    step, and cached generation still equals recomputing every step, tokens and logits."""
    from hybrid_llama.eval.throughput import greedy_decode
    from hybrid_llama.layers import hybrid_attention as layer_module
    from hybrid_llama.models import convert_to_hybrid, load_model
    from hybrid_llama.weights import resolve_model

    model, _ = load_model(resolve_model({"kind": "random", "preset": "tiny"}, str(tmp_path / "tiny")))
    w, sinks, prompt, new = 4, 1, 9, 10
    convert_to_hybrid(model, layers=[0, 1], window=w, formulation="lolcats", feature_map="hedgehog",
                      sparse_cache=3, sinks=sinks, softmax_heads=[[1, 0]], decay=0.99)
    model.eval()
    general = count_calls(monkeypatch, layer_module, "hybrid_attention_step")
    rotated_natively = count_calls(monkeypatch, cpu_step, "_rope_pointers")
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = greedy_decode(model, ids, new)
    closing = sum(1 for t in range(prompt, prompt + new) if t - w >= sinks and (t - w - sinks) % w == w - 1)
    assert closing == 2 and general == {"ran": 2 * closing, "declined": 0}
    native = 2 * (new - closing)
    # a closing step is declined twice: by the layer's call, then by the general step's
    assert native_sparse_calls == {"ran": native, "declined": 2 * 2 * closing}
    assert rotated_natively == {"ran": native, "declined": 0}
    with torch.no_grad():
        assert torch.equal(tokens, greedy_decode(model, ids, new, use_cache=False))
        # the steps' logits against one uncached forward of the whole sequence
        sequence = torch.cat([ids, tokens], dim=1)
        uncached = model(input_ids=sequence).logits[0, prompt - 1 : prompt + new - 1]
        out = model(input_ids=ids, use_cache=True)
        cache, logits = out.past_key_values, [out.logits[0, -1]]
        for t in range(prompt, prompt + new - 1):
            out = model(input_ids=sequence[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    torch.testing.assert_close(torch.stack(logits), uncached, atol=1e-4, rtol=1e-4)


def test_peft_wrapped_layers_decode_with_their_trained_copies(tmp_path):
    """Under peft's modules_to_save (how the LoRA stage trains mixing logits and feature maps) the
    layers read the wrapper's trained copies at every step: cached greedy generation gives the
    merged model's logits, not the logits of the copies peft keeps as originals."""
    import copy

    import peft

    from hybrid_llama.models import convert_to_hybrid, load_model
    from hybrid_llama.weights import resolve_model

    model, _ = load_model(resolve_model({"kind": "random", "preset": "tiny"}, str(tmp_path / "tiny")))
    convert_to_hybrid(model, layers=[0, 1], window=4, formulation="lolcats", feature_map="hedgehog")
    original = copy.deepcopy(model).eval()
    cfg = peft.LoraConfig(r=2, target_modules=["o_proj"], modules_to_save=["mixing", "feature_map"])
    wrapped = peft.get_peft_model(model, cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".modules_to_save." in name:
                p.add_(torch.randn(p.shape, generator=g))
    merged = copy.deepcopy(wrapped).merge_and_unload().eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))

    def logits(m):
        out = m.generate(input_ids=ids, max_new_tokens=10, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
        return torch.stack(out.logits)

    got = logits(wrapped)
    torch.testing.assert_close(got, logits(merged), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, logits(original), atol=1e-2)


def test_without_a_compiler_the_torch_step_runs_and_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HYBRID_LLAMA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    for name in ("_library", "_why_not", "built_with"):
        monkeypatch.setattr(native, name, None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None and native.load() is None
    assert len([r for r in caplog.records if "native CPU kernels are unavailable" in r.getMessage()]) == 1
    assert "false" in native.why_not() and list(tmp_path.glob("*")) == []  # no half-written file left
    q, k, v, wl, ll, _, _ = problem(1, 2, 2, 1, 4, "elu1")
    with torch.no_grad():
        out, state = hybrid_attention_step(q, k, v, init_state(1, 2, 4, 3), wl, ll, inplace=True)
    assert state.seen == 1 and torch.allclose(out, v)  # one key: the output is its value
