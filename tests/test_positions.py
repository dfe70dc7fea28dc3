"""Training at shifted positions (``max_position``): the teacher's targets stay, the students move."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F

import hybrid_llama.train.finetune as ft
import hybrid_llama.train.transfer as tr
from hybrid_llama.data import load_packed, prepare_transfer_corpus
from hybrid_llama.models import make_hybrid_attention
from hybrid_llama.stages import as_hybrid_config, load_base
from hybrid_llama.train.positions import RowShift, check_max_position, position_ids, row_offsets
from hybrid_llama.train.settings import LoraSettings, TransferSettings
from hybrid_llama.train.trainer import batch_order

HEDGEHOG = {"layers": [1, 3], "window": 4, "formulation": "lolcats", "feature_map": "hedgehog"}
SEQ = 32


@pytest.fixture(scope="module")
def rows_path(lively_dir, shared_data_dir, tmp_path_factory):
    path = shared_data_dir / "fineweb-edu" / "fineweb-edu-sample-10BT.150docs.text.jsonl"
    if not path.exists():
        pytest.skip(f"shared data missing: {path}")
    out = tmp_path_factory.mktemp("shift") / "train.safetensors"
    prepare_transfer_corpus({"kind": "local", "path": str(path)}, lively_dir, out, split="train",
                            num_tokens=SEQ * 10, seq_len=SEQ, heldout_fraction=0.2, seed=0)
    return out


def test_row_offsets_are_seeded_per_row_and_step_and_stay_in_range():
    a = row_offsets([0, 1, 2, 3], step=5, seed=0, seq_len=100, max_position=1000)
    assert a == row_offsets([0, 1, 2, 3], step=5, seed=0, seq_len=100, max_position=1000)
    assert all(0 <= o <= 900 for o in a) and len(set(a)) > 1
    assert a != row_offsets([0, 1, 2, 3], step=6, seed=0, seq_len=100, max_position=1000)
    assert a != row_offsets([0, 1, 2, 3], step=5, seed=1, seq_len=100, max_position=1000)
    draws = [o for s in range(200) for o in row_offsets([0], s, 0, 100, 1000)]
    assert min(draws) < 100 and max(draws) > 800  # the whole range is drawn
    assert row_offsets([0, 1], 1, 0, 100, 0) is None and row_offsets([0], 1, 0, 100, 100) is None
    assert position_ids([3, 7], 4, "cpu").tolist() == [[3, 4, 5, 6], [7, 8, 9, 10]]


def _coverage(draw: str, seq_len: int, max_position: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """The share of n drawn rows that hold each position below max_position, and the starts."""
    starts = [o for s in range(n) for o in row_offsets([0], s, 0, seq_len, max_position, draw)]
    held = torch.zeros(max_position)
    for s in starts:
        held[s : s + seq_len] += 1
    return held / n, starts


def test_cover_draw_trains_every_position_and_uniform_leaves_the_last_ones():
    """The two laws, counted over many draws against their definitions (train.positions): cover's start
    is uniform on [-(L - 1), M - 1] clamped into [0, M - L], so every position is held by at least
    L / (M + L - 1) of the rows and each end is a start that often; uniform's start is uniform on
    [0, M - L], so position M - 1 is held by 1 / (M - L + 1) of them."""
    L, M, n = 100, 1000, 20000
    floor = L / (M + L - 1)
    cover, starts = _coverage("cover", L, M, n)
    assert min(starts) == 0 and max(starts) == M - L
    assert float(cover.min()) > 0.93 * floor  # binomial noise of n draws: sd about 2.4 % of floor
    for p in (0, M - 1):
        assert float(cover[p]) == pytest.approx(floor, rel=0.07)
    assert starts.count(0) / n == pytest.approx(floor, rel=0.07) == starts.count(M - L) / n
    assert float(cover[M // 2]) == pytest.approx(L / (M + L - 1), rel=0.07)  # the middle: no row clamped
    uniform, _ = _coverage("uniform", L, M, n)
    assert float(uniform[M - 1]) < 0.1 * floor and float(uniform[M // 2]) == pytest.approx(L / (M - L + 1), rel=0.07)


def test_uniform_draw_reproduces_the_starts_before_the_cover_draw():
    """Runs trained before position_draw existed used the uniform law: the same seeds give the same starts."""
    assert row_offsets([0, 1, 2, 3], 5, 0, 2048, 8192, "uniform") == [2889, 1471, 3261, 3323]
    assert row_offsets([7], 11, 3, 100, 1000, "uniform") == [530]
    with pytest.raises(ValueError, match="position draw 'edges'"):
        row_offsets([0], 1, 0, 100, 1000, "edges")


def test_row_shift_reads_a_stage_settings_and_gives_the_drawn_position_ids():
    """The objectives' one value for (max_position, seed, draw): its position ids are the drawn starts'."""
    s = TransferSettings.from_dict({"max_position": 8192, "seed": 3, "position_draw": "cover"})
    shift = RowShift.of(s)
    assert shift == RowShift(8192, 3, "cover")
    assert RowShift.of(LoraSettings.from_dict({"max_position": 4096, "seed": 5})) == RowShift(4096, 5, "uniform")
    ids = shift.position_ids([0, 4], 7, 2048, "cpu")
    starts = row_offsets([0, 4], 7, 3, 2048, 8192, "cover")
    assert ids.tolist() == [list(range(a, a + 2048)) for a in starts]
    assert RowShift().position_ids([0], 1, 2048, "cpu") is None  # max_position 0: rows stay at 0
    assert RowShift(2048, 0).position_ids([0], 1, 2048, "cpu") is None  # no room to shift
    with pytest.raises(ValueError, match="position draw 'edges'"):
        RowShift(8192, 0, "edges")


def test_max_position_is_checked_against_the_row_and_the_model():
    check_max_position(0, 2048, 8192, "transfer.max_position")
    check_max_position(8192, 2048, 8192, "transfer.max_position")
    with pytest.raises(ValueError, match="transfer.max_position=9000 exceeds the model's 8192"):
        check_max_position(9000, 2048, 8192, "transfer.max_position")
    with pytest.raises(ValueError, match="lora.max_position=1000 is shorter"):
        check_max_position(1000, 2048, 8192, "lora.max_position")


def test_a_shift_leaves_softmax_attention_and_moves_the_hybrid_layer(lively_dir):
    """The premise: the teacher is relative in position, a post-RoPE Hedgehog layer is not."""
    model, _ = load_base(lively_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        shifted = model(input_ids=ids, position_ids=torch.arange(48)[None] + 3000).logits
        assert torch.allclose(plain, shifted, atol=2e-3, rtol=0)  # fp32 RoPE angles near 3000 round at ~1e-4
        layer = make_hybrid_attention(model.model.layers[1].self_attn, as_hybrid_config(HEDGEHOG))
        h = torch.randn(1, 48, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
        outs = [layer(hidden_states=h, position_embeddings=model.model.rotary_emb(h, torch.arange(48)[None] + s),
                      attention_mask=None)[0] for s in (0, 3000)]
    near, far = (outs[0][:, :4] - outs[1][:, :4]).abs().max(), (outs[0][:, 8:] - outs[1][:, 8:]).abs().max()
    scale = outs[0].abs().max()
    assert near < 1e-3 * scale  # inside the window: softmax, moved by rounding only
    assert far > 1e-2 * scale and far > 30 * near  # beyond it the feature maps read the angles


def test_transfer_first_step_is_the_shifted_student_against_the_unshifted_teacher(lively_dir, rows_path, tmp_path):
    """loss.csv's step-1 MSE, recomputed independently: the teacher run at the drawn positions gives
    the students' inputs (RoPE at the shift), the teacher run at 0 gives the targets."""
    cfg = {"progress": False, "autocast": False, "trainable": "logits+feature_map", "lr": 1e-2, "batch_size": 2,
           "epochs": 1, "eval_sequences": 2, "checkpoint_every": 0, "max_steps": 1}
    tr.run_transfer(lively_dir, rows_path, HEDGEHOG, {**cfg, "max_position": 4096}, tmp_path / "on")
    tr.run_transfer(lively_dir, rows_path, HEDGEHOG, cfg, tmp_path / "off")

    def step1(d):
        with open(d / "loss.csv") as f:
            return {int(r["layer"]): float(r["mse"]) for r in csv.DictReader(f) if r["step"] == "1"}

    train = load_packed(rows_path)[:-2]
    rows = batch_order(len(train), 0, 0)[:2]
    offsets = row_offsets(rows, 1, 0, SEQ, 4096)
    teacher, _ = load_base(lively_dir, dtype=torch.float32)
    hcfg = as_hybrid_config(HEDGEHOG)
    ins, outs = {}, {}
    hooks = [teacher.model.layers[i].self_attn.register_forward_pre_hook(
        lambda m, a, k, i=i: ins.__setitem__(i, k), with_kwargs=True) for i in hcfg.layers]
    hooks += [teacher.model.layers[i].self_attn.register_forward_hook(
        lambda m, a, o, i=i: outs.__setitem__(i, o[0])) for i in hcfg.layers]
    with torch.no_grad():
        teacher(input_ids=train[rows])
        targets = dict(outs)
        teacher(input_ids=train[rows], position_ids=position_ids(offsets, SEQ, "cpu"))
        expect = {}
        for i in hcfg.layers:
            student = make_hybrid_attention(teacher.model.layers[i].self_attn, hcfg).float()
            y = student(hidden_states=ins[i]["hidden_states"], position_embeddings=ins[i]["position_embeddings"],
                        attention_mask=ins[i]["attention_mask"])[0]
            expect[i] = F.mse_loss(y, targets[i]).item()
    for h in hooks:
        h.remove()
    got, unshifted = step1(tmp_path / "on"), step1(tmp_path / "off")
    for i in hcfg.layers:
        assert got[i] == pytest.approx(expect[i], rel=1e-4)
        assert abs(got[i] - unshifted[i]) > 1e-4 * unshifted[i]


def test_lora_trains_shifted_rows_and_validates_at_zero(lively_dir, rows_path, tmp_path):
    seen = []
    orig = ft._lora_model

    def spy(*a, **k):
        model, targets, save = orig(*a, **k)
        inner = model.get_base_model().model
        inner.register_forward_pre_hook(lambda m, a, k: seen.append((m.training, k.get("position_ids"))),
                                        with_kwargs=True)
        return model, targets, save

    ft._lora_model = spy
    try:
        with pytest.raises(ValueError, match="lora.max_position=100000 exceeds"):
            ft.run_finetune(lively_dir, rows_path, {"objective": "distill", "max_position": 100000, "progress": False},
                            tmp_path / "bad", hybrid=HEDGEHOG)
        ft.run_finetune(lively_dir, rows_path,
                        {"objective": "distill", "max_position": 1024, "progress": False, "autocast": False,
                         "batch_size": 2, "max_steps": 2, "eval_sequences": 2, "checkpoint_every": 0},
                        tmp_path / "ok", hybrid=HEDGEHOG)
    finally:
        ft._lora_model = orig
    trained = [p for training, p in seen if training]
    assert len(trained) == 2 and all(p is not None for p in trained)
    for p in trained:
        assert p.shape == (2, SEQ) and (p[:, 1:] - p[:, :-1] == 1).all()
        assert (p[:, 0] >= 0).all() and (p[:, -1] < 1024).all()
    assert len({int(x) for p in trained for x in p[:, 0]}) > 1
    assert all(p is None for training, p in seen if not training)  # validation at positions 0..T-1


def test_window_nll_at_a_start_moves_a_hybrid_and_leaves_softmax(lively_dir):
    """``window_nll(..., start)`` scores the window at positions start.. (benchmarks/probe_positions.py):
    base, relative in position, scores the same; a converted hybrid, whose maps read the angles, does not."""
    from hybrid_llama.eval.perplexity import window_nll
    from hybrid_llama.stages import load_stage

    base, _ = load_stage(lively_dir, "base", dtype=torch.float32)
    hybrid, _ = load_stage(lively_dir, "converted", hybrid=HEDGEHOG, dtype=torch.float32)
    w = torch.randint(3, base.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(4))
    at0, at3000 = window_nll(base, w, 16), window_nll(base, w, 16, start=3000)
    assert torch.allclose(at0, at3000, atol=2e-3)
    moved = (window_nll(hybrid, w, 16) - window_nll(hybrid, w, 16, start=3000)).abs().max()
    assert moved > 1e-2 and moved > 10 * (at0 - at3000).abs().max()
