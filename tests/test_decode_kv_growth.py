"""CPU tests of the decoder's KV growth (``DecodeKV(growth=True)``, ``FastGenerator(kv_growth=True)``).

The cache storage follows the window: its length capacity grows with the attention bucket and its rows shrink
at each compaction. Same tiny random Qwen2 / Llama as ``tests/test_decode_compaction.py`` (12-token vocabulary,
two EOS ids, greedy rows ending between step 1 and the cap of 40, prompts of up to 11 tokens): with
``attn_bucket=4`` the capacity grows from 12 to 52 positions through 11 buckets while the batch is compacted
12 -> 6 -> 1, so the storage is both grown and shrunk. On CPU the same copies run as on the GPU, without graphs.
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import pytest
import torch

from tests.test_decode_compaction import EOS, N, PAD, compacting, rows, small_vocab_model
from tests.test_generation import hf_greedy
from data_tools.generation.fast_decoder import FastGenerator, SamplingParams
from data_tools.generation.kv_cache import DecodeKV, attn_len, kv_peak_bytes, window_path

GREEDY = SamplingParams(max_new_tokens=N, do_sample=False)


def _kv_token_bytes(model) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4  # fp32


def _filled(B=4, cap=4, L=10, layers=2):
    """A growth ``DecodeKV`` whose layers hold distinct values at positions [:3] (zeros beyond)."""
    kv = DecodeKV(B, L, torch.float32, "cpu", growth=True)
    kv.begin(cap)
    kv.b, kv.lb, kv.pos = B, 3, torch.arange(3)
    ref = {}
    for layer in range(layers):
        k = torch.arange(B * 2 * 3 * 2, dtype=torch.float32).view(B, 2, 3, 2) + 100 * layer
        kv.update(k, -k, layer)
        ref[layer] = k
    return kv, ref


def test_reserve_grows_to_the_bucket_and_keeps_the_written_positions():
    kv, ref = _filled()
    assert kv.cap == 4 and kv.k[0].shape == (4, 2, 4, 2) and kv.nbytes() == 2 * 2 * 4 * 2 * 4 * 2 * 4
    epoch = kv.epoch
    assert kv.reserve(4, written=3) is False and kv.epoch == epoch  # fits: nothing moves
    assert kv.reserve(7, written=3) is True
    assert kv.cap == 7 and kv.epoch != epoch
    for layer, k in ref.items():
        assert kv.k[layer].shape == (4, 2, 7, 2) and kv.v[layer].shape == (4, 2, 7, 2)
        assert torch.equal(kv.k[layer][:, :, :3], k) and torch.equal(kv.v[layer][:, :, :3], -k)
        assert torch.count_nonzero(kv.k[layer][:, :, 3:]) == 0 and torch.count_nonzero(kv.v[layer][:, :, 3:]) == 0
    assert kv.nbytes() == 2 * 2 * 4 * 2 * 7 * 2 * 4
    # the high-water mark: the new storage plus the last layer's old V (4 x 2 x 4 x 2 floats) while it was replaced
    assert kv.peak_bytes == kv.nbytes() + 4 * 2 * 4 * 2 * 4
    assert kv.reserve(50, written=3) is True and kv.cap == 10  # never past L
    kv.lb, kv.pos = 10, torch.tensor([9])
    kk, _ = kv.update(torch.ones(4, 2, 1, 2), torch.ones(4, 2, 1, 2), 0)  # fine within the capacity
    assert kk.shape == (4, 2, 10, 2) and torch.equal(kk[:, :, 9], torch.ones(4, 2, 2))
    kv.begin(4)  # a new call: storage dropped, capacity back to the first bucket
    assert kv.nbytes() == 0 and kv.k == {} and kv.cap == 4 and kv.peak_bytes == 0


def test_a_window_past_the_capacity_is_refused_not_allocated():
    """The step never allocates (it may run inside a CUDA-graph capture): growth is the caller's, before it."""
    kv, _ = _filled()
    kv.lb, kv.pos = 5, torch.tensor([3])
    with pytest.raises(RuntimeError, match="exceeds the storage capacity 4"):
        kv.update(torch.ones(4, 2, 1, 2), torch.ones(4, 2, 1, 2), 0)
    assert kv.cap == 4 and kv.k[0].shape == (4, 2, 4, 2)


def test_compact_with_growth_frees_the_dropped_rows():
    kv, ref = _filled()
    kv.mask[:, 0, 0, :3] = 0.0
    kv.mask[1, 0, 0, 0] = -5.0
    before = kv.nbytes()
    epoch = kv.epoch
    kv.compact(torch.tensor([3, 1]), written=3)
    assert kv.b == 2 and kv.epoch != epoch
    assert kv.nbytes() == before // 2  # 2 of 4 rows: the storage itself is smaller, not a prefix of it
    for layer, k in ref.items():
        assert kv.k[layer].shape == (2, 2, 4, 2)
        assert torch.equal(kv.k[layer][:, :, :3], k[[3, 1]]) and torch.equal(kv.v[layer][:, :, :3], -k[[3, 1]])
        assert torch.count_nonzero(kv.k[layer][:, :, 3:]) == 0
    assert kv.mask[1, 0, 0, 0] == -5.0 and kv.mask[0, 0, 0, 0] == 0.0
    # without growth the same compaction moves rows inside the full storage and frees nothing
    flat = DecodeKV(4, 10, torch.float32, "cpu")
    flat.pos = torch.arange(3)
    flat.update(ref[0], -ref[0], 0)
    full = flat.nbytes()
    flat.compact(torch.tensor([3, 1]), written=3)
    assert flat.nbytes() == full and flat.k[0].shape == (4, 2, 10, 2)


@pytest.mark.parametrize("attn,gqa,arch", [("sdpa", True, "qwen2"), ("sdpa", False, "qwen2"), ("eager", True, "llama")])
def test_greedy_growth_equals_off_and_hf_generate(attn, gqa, arch):
    model = small_vocab_model(attn, arch)
    ps = rows()
    ref = hf_greedy(model, ps, N, PAD, EOS)
    assert len({len(r) for r in ref}) >= 6 and max(map(len, ref)) == N  # rows end at many different steps
    off = compacting(gqa_attention=gqa)
    assert off.generate(model, ps, GREEDY) == ref
    on = compacting(gqa_attention=gqa, kv_growth=True)
    assert on.generate(model, ps, GREEDY) == ref
    assert on.last["steps"] == off.last["steps"] and on.last["compactions"] == off.last["compactions"] >= 2

    win = on.last["windows"]  # (t, b, lb, cap, bytes) at each change
    P = max(map(len, ps))
    L = -(-(P + N) // 8) * 8  # the static length: prompt + cap rounded up to len_bucket 8
    assert win[0][:4] == (0, 12, P, attn_len(P + 1, L, 4))  # the prefill's storage: the first step's bucket
    assert all(cap == lb for _, _, lb, cap, _ in win[1:])  # the capacity is the window's bucket, no more
    caps = [w[3] for w in win]
    assert caps == sorted(caps) and len(set(caps)) >= 10  # grown ten times or more, 12 -> 52
    assert [w[1] for w in win] == sorted((w[1] for w in win), reverse=True) and win[-1][1] == 1
    tok = _kv_token_bytes(model)
    assert all(nbytes == b * cap * tok for _, b, _, cap, nbytes in win)  # the storage is b x cap, exactly
    shrinks = [i for i in range(1, len(win)) if win[i][1] < win[i - 1][1]]
    assert len(shrinks) >= 2 and all(win[i][4] < win[i - 1][4] for i in shrinks)  # a compaction frees memory
    # every change of rows or capacity is one reallocation (a step may grow and shrink at once: counted once)
    assert on.last["reallocations"] == sum(win[i][1::2] != win[i - 1][1::2] for i in range(1, len(win))) >= 10
    # the host-side replay of the rule gives the same windows, and the peak its formula says
    lengths = [len(r) for r in ref]
    path = window_path(P, lengths, N, L, check_every=2, attn_bucket=4, min_batch_bucket=1, growth=True)
    assert path == [w[:4] for w in win]
    steady = kv_peak_bytes(path, 12, True, tok)
    assert steady == max(b * cap for _, b, _, cap in path) * tok
    assert steady <= on.last["kv_peak_bytes"] <= 1.5 * steady  # + one layer's old K or V in a reallocation
    # without growth: the full B x L storage all along
    assert off.last["kv_peak_bytes"] == 12 * L * tok == kv_peak_bytes(
        window_path(P, lengths, N, L, check_every=2, attn_bucket=4, min_batch_bucket=1, growth=False), 12, False, tok)
    assert on.last["kv_peak_bytes"] < 0.6 * off.last["kv_peak_bytes"]


def test_sampled_tokens_and_logprobs_with_growth_equal_off_under_a_seed():
    """Same RNG draws (the batch shapes do not change), same tokens; forced lengths make rows end everywhere."""
    model = small_vocab_model()
    ps = [p for p in rows()[:4] for _ in range(3)]  # G = 3 samples of each prompt in a row
    want = [1, 3, 40, 7, 2, 40, 18, 5, 9, 33, 12, 26]
    sp = SamplingParams(max_new_tokens=N, do_sample=True, temperature=0.8, top_k=8)
    got = {}
    for growth in (False, True):
        gen = compacting(kv_growth=growth)
        torch.manual_seed(5)
        free = gen.generate(model, ps, sp, return_logprobs=True)
        torch.manual_seed(6)
        forced = gen.generate(model, ps, sp, forced_lengths=want)
        got[growth] = (free, forced, gen.last["reallocations"])
    (free0, lp0), forced0, _ = got[False]
    (free1, lp1), forced1, realloc = got[True]
    assert free1 == free0 and forced1 == forced0 and [len(c) for c in forced1] == want
    assert realloc >= 10  # the growing cache really was reallocated along the way
    for a, b in zip(lp0, lp1):
        assert a == pytest.approx(b, abs=1e-5)


def test_keep_cache_with_growth_restarts_the_storage_each_call():
    model = small_vocab_model()
    ps = rows()
    ref = hf_greedy(model, ps, N, PAD, EOS)
    gen = compacting(kv_growth=True, keep_cache=True)
    assert gen.generate(model, ps, GREEDY) == ref
    st = gen._state
    assert st.kv.nbytes() == 0 and st.graphs == {} and st.retired == []  # freed after the call, state kept
    first = list(gen.last["windows"])
    assert gen.generate(model, ps, GREEDY) == ref
    assert gen._state is st and gen.stats["captures"] == 1 and gen.last["windows"] == first  # B rows again


def test_graphs_of_a_replaced_storage_are_retired_never_kept():
    """``_decode`` calls ``retire_stale_graphs`` before every lookup: after a reallocation no graph is found."""
    model = small_vocab_model()
    gen = compacting(kv_growth=True, keep_cache=True)
    gen.generate(model, rows(), GREEDY)
    st, kv = gen._state, gen._state.kv
    kv.begin(16)
    kv.b, kv.lb, kv.pos = 12, 13, torch.arange(13)
    for layer in range(2):  # the prefill's writes allocate the storage: a new epoch
        kv.update(torch.randn(12, 2, 13, 16), torch.randn(12, 2, 13, 16), layer)
    st.retire_stale_graphs()
    st.graphs[(12, 16)] = "graph captured on this storage"
    st.retire_stale_graphs()
    assert st.graphs == {(12, 16): "graph captured on this storage"} and st.retired == []  # same storage: kept
    assert kv.reserve(20, written=13)
    st.retire_stale_graphs()
    assert st.graphs == {} and st.retired == ["graph captured on this storage"]
    st.graphs[(12, 20)] = "g2"
    st.compact(6, 13)  # a shrink replaces the storage too
    st.retire_stale_graphs()
    assert st.graphs == {} and st.retired == ["graph captured on this storage", "g2"]
    st.pool = "pool"
    st.free_graphs()
    assert st.retired == [] and st.pool is None  # the next capture starts a new pool


def test_growth_needs_compaction(caplog):
    from data_tools.generation import fast_decoder as generation

    model = small_vocab_model()
    ps = rows()
    msg = "decode_kv_growth needs decode_compaction"
    generation._warned_compile.difference_update({m for m in generation._warned_compile if m.startswith(msg)})
    gen = FastGenerator(PAD, EOS, len_bucket=8, check_every=2, kv_growth=True, keep_cache=True)
    with caplog.at_level(logging.WARNING, logger="data_tools.generation.fast_decoder"):
        assert gen.generate(model, ps, GREEDY) == hf_greedy(model, ps, N, PAD, EOS)
    assert any(r.message.startswith(msg) for r in caplog.records)
    L = -(-(max(map(len, ps)) + N) // 8) * 8
    assert not gen._state.kv.growth and gen.last["kv_peak_bytes"] == 12 * L * _kv_token_bytes(model)
    assert {w[3] for w in gen.last["windows"]} == {L}


def test_realistic_batch_expected_peak():
    """The docstring's figures: the realistic bench's batch (128 rows, cap 8,192, seed 0) with 256-token buckets."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import step_realism as sr

    tok = 2 * 28 * 2 * 128 * 2  # Qwen2.5-1.5B, bf16: 28,672 B per token
    kw = dict(check_every=128, attn_bucket=256, min_batch_bucket=8)
    for batch, (t, lb) in ((0, (2561, 3072)), (1, (2305, 2816))):
        lengths, _ = sr.draw_lengths(128, 8192, 0, batch)
        path = window_path(256, lengths, 8192, 8448, growth=True, **kw)
        top = max(path, key=lambda w: w[1] * w[3])
        assert top == (t, 128, lb, lb)  # the last window before the first compaction to 64 rows
        assert kv_peak_bytes(path, 128, True, tok) == 128 * lb * tok
        assert kv_peak_bytes(window_path(256, lengths, 8192, 8448, growth=False, **kw), 128, False, tok) == \
            128 * 8448 * tok
    assert round(128 * 8448 * tok / 2**30, 1) == 28.9
    assert round(128 * 2816 * tok / 2**30, 1) == 9.6 and round(128 * 3072 * tok / 2**30, 1) == 10.5


def test_flag_reaches_the_generator_from_every_entry_point():
    """``OPDConfig.decode_kv_growth`` (on by default, ignored without compaction) -> ``fast_generate_single_turn``;
    the hf engine and benches."""
    from tests.test_fsdp_generation import stub_trainer
    from data_tools.generation.fast_decoder import decode_options
    from trainers.fast_generation import fast_generate_single_turn
    from trainers.opd_config import OPDConfig

    assert OPDConfig.__dataclass_fields__["decode_kv_growth"].default is True
    # the one place the three flags become FastGenerator's arguments (trainer, async rollouts, hf engine)
    assert decode_options(True, False, True) == {"compaction": True, "compile_step": False, "kv_growth": True}
    assert decode_options(False, True, True) == {"compaction": False, "compile_step": True, "kv_growth": False}
    model = small_vocab_model()
    ps = rows()
    tr = stub_trainer(model, N)
    tr.generation_config.eos_token_id, tr.eos_token_ids, tr._tokenizer.pad_token_id = EOS, EOS, PAD
    tr.args.decode_compaction, tr.args.decode_kv_growth = True, True
    assert fast_generate_single_turn(tr, ps) == hf_greedy(model, ps, N, PAD, EOS)
    gen = model._opd_fast_generator
    assert gen.kv_growth and gen.compaction
    tr.args.decode_kv_growth = False
    fast_generate_single_turn(tr, ps)
    assert not model._opd_fast_generator.kv_growth
    tr.args.decode_compaction, tr.args.decode_kv_growth = False, True  # nothing to follow: off, and no warning
    fast_generate_single_turn(tr, ps)
    assert not model._opd_fast_generator.kv_growth and not model._opd_fast_generator.compaction

    from data_tools.generation.engines import HFEngine

    assert inspect.signature(HFEngine).parameters["decode_kv_growth"].default is True
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import decode_bench as db
    import opd_step_realistic as osr

    assert db.MODES["compaction+grow"] == (True, False, True) and db.MODES["compaction"] == (True, False, False)
    out, notes = osr.variant_overrides(["compact+grow"])
    assert notes == [] and out["compact+grow"]["decode_compaction"] is True
    assert out["compact+grow"]["decode_kv_growth"] is True and out["compact+grow"]["decode_compile"] is False
