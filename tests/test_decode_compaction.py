"""CPU tests of the decoder's compaction (``data_tools.generation.kv_cache``): buckets, and equal tokens with it on and off.

A tiny random Qwen2 with a 12-token vocabulary and two EOS ids: greedy rows finish between step 1 and the
cap (lengths 1 ... 40), so the batch is compacted several times and the attention window moves through
several length buckets. On CPU the same gather code runs as on the GPU, without graphs.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.test_generation import hf_greedy, prompts
from data_tools.generation.fast_decoder import FastGenerator, SamplingParams
from data_tools.generation.kv_cache import DecodeKV, attn_len, batch_buckets

EOS, PAD, N = [1, 2], 0, 40


def small_vocab_model(attn="sdpa", arch="qwen2"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    kw = dict(vocab_size=12, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, attn_implementation=attn)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    return Qwen2ForCausalLM(Qwen2Config(**kw)).float().eval()


def rows():
    # 12 prompts of 2..13 tokens, ids 3..11 (no pad / EOS inside a prompt)
    return [[max(3, t) for t in p] for p in prompts(n=12, lo=2, hi=14, vocab=12)]


def compacting(**kw):
    return FastGenerator(PAD, EOS, len_bucket=8, check_every=2, compaction=True, attn_bucket=4, min_batch_bucket=1,
                         **kw)


def test_attn_len_buckets():
    assert [attn_len(n, 10_000, 256) for n in (1, 256, 257, 4096, 4097, 8192, 8193)] == \
           [256, 256, 512, 4096, 4608, 8192, 9216]
    assert attn_len(9000, 8448, 256) == 8448  # never past the static length
    # 8,448 positions (a 256-token prompt + an 8,192 cap) take 25 buckets, each at most 1/8 padding
    seen = {attn_len(n, 8448, 256) for n in range(1, 8449)}
    assert len(seen) == 25
    assert all(attn_len(n, 8448, 256) - n < max(256, n / 8) for n in range(1, 8449))


def test_batch_buckets():
    assert batch_buckets(128, 8) == [128, 64, 32, 16, 8]
    assert batch_buckets(12, 1) == [12, 6, 3, 2, 1]
    assert batch_buckets(6, 8) == [6]


def test_decode_kv_compact_moves_live_rows():
    kv = DecodeKV(4, 6, torch.float32, "cpu")
    kv.pos = torch.arange(3)
    k = torch.arange(4 * 2 * 3 * 2, dtype=torch.float32).view(4, 2, 3, 2)
    kv.update(k, -k, 0)
    kv.mask[:, 0, 0, :3] = 0.0
    kv.mask[1, 0, 0, 0] = -5.0
    kv.compact(torch.tensor([3, 1]), written=3)
    assert kv.b == 2
    assert torch.equal(kv.k[0][:2, :, :3], k[[3, 1]]) and torch.equal(kv.v[0][:2, :, :3], -k[[3, 1]])
    assert kv.mask[1, 0, 0, 0] == -5.0 and kv.mask[0, 0, 0, 0] == 0.0
    kv.lb, kv.pos = 4, torch.tensor([3])
    kk, vv = kv.update(torch.ones(2, 2, 1, 2), torch.ones(2, 2, 1, 2), 0)
    assert kk.shape == (2, 2, 4, 2) and torch.equal(kk[:, :, 3], torch.ones(2, 2, 2))


@pytest.mark.parametrize("attn,gqa,arch", [("sdpa", True, "qwen2"), ("sdpa", False, "qwen2"), ("eager", True, "llama")])
def test_greedy_compaction_equals_off_and_hf_generate(attn, gqa, arch):
    model = small_vocab_model(attn, arch)
    ps = rows()
    ref = hf_greedy(model, ps, N, PAD, EOS)
    assert len({len(r) for r in ref}) >= 6 and max(map(len, ref)) == N  # finishes spread from step 1 to the cap
    off = FastGenerator(PAD, EOS, len_bucket=8, check_every=2, gqa_attention=gqa)
    assert off.generate(model, ps, SamplingParams(max_new_tokens=N, do_sample=False)) == ref
    on = compacting(gqa_attention=gqa)
    assert on.generate(model, ps, SamplingParams(max_new_tokens=N, do_sample=False)) == ref
    assert on.last["compactions"] >= 2
    assert on.last["row_steps"] < 0.6 * off.last["row_steps"]
    assert on.last["attn_row_tokens"] < 0.4 * off.last["attn_row_tokens"]


def test_forced_lengths_sampling_with_compaction():
    """Forced EOS (the bench hook) under sampling: exact lengths, one EOS at the end, tokens in the vocabulary."""
    model = small_vocab_model()
    ps = rows()
    want = [1, 3, 40, 7, 2, 40, 18, 5, 9, 33, 12, 26]
    sp = SamplingParams(max_new_tokens=N, do_sample=True, temperature=1.0, top_p=0.95)
    for gen in (FastGenerator(PAD, EOS, len_bucket=8, check_every=2), compacting()):
        torch.manual_seed(0)
        got = gen.generate(model, ps, sp, forced_lengths=want)
        assert [len(c) for c in got] == [min(w, N) for w in want]
        for c, w in zip(got, want):
            assert all(0 <= t < 12 for t in c)
            assert all(t not in EOS for t in c[:-1])
            assert (c[-1] in EOS) == (w <= N)
    assert gen.last["compactions"] >= 2


def test_greedy_forced_lengths_on_equals_off():
    model = small_vocab_model()
    ps = rows()
    want = [40, 3, 40, 7, 2, 40, 18, 5, 9, 33, 12, 26]
    sp = SamplingParams(max_new_tokens=N, do_sample=False)
    off = FastGenerator(PAD, EOS, len_bucket=8, check_every=3).generate(model, ps, sp, forced_lengths=want)
    on = compacting().generate(model, ps, sp, forced_lengths=want)
    assert on == off and [len(c) for c in on] == want


def test_sampling_compaction_valid_and_seeded():
    model = small_vocab_model()
    ps = [p for p in rows()[:4] for _ in range(3)]  # G = 3 samples of each prompt in a row
    sp = SamplingParams(max_new_tokens=N, do_sample=True, temperature=0.8, top_k=8)
    gen = compacting()
    torch.manual_seed(5)
    a = gen.generate(model, ps, sp)
    torch.manual_seed(5)
    b = gen.generate(model, ps, sp)
    assert a == b  # same seed, same completions (the RNG draws do not depend on timing)
    for c in a:
        assert 1 <= len(c) <= N and all(0 <= t < 12 for t in c)
        assert all(t not in EOS for t in c[:-1]) and (c[-1] in EOS or len(c) == N)


def test_decode_compile_falls_back_on_cpu(caplog):
    model = small_vocab_model()
    ps = rows()
    with caplog.at_level(logging.WARNING, logger="data_tools.generation.fast_decoder"):
        got = compacting(compile_step=True).generate(model, ps, SamplingParams(max_new_tokens=N, do_sample=False))
    assert got == hf_greedy(model, ps, N, PAD, EOS)
    assert any("decode_compile" in r.message for r in caplog.records)


def test_trainer_flags_reach_the_generator():
    """``OPDConfig.decode_compaction`` / ``decode_compile`` as ``fast_generate_single_turn`` reads them."""
    from tests.test_fsdp_generation import stub_trainer
    from trainers.fast_generation import fast_generate_single_turn
    from trainers.opd_config import OPDConfig

    names = {f for f in OPDConfig.__dataclass_fields__}
    assert {"decode_compaction", "decode_compile"} <= names
    # compaction on by default (it won on the H200, bench/RESULTS.md run 7); compile off by default
    assert OPDConfig.__dataclass_fields__["decode_compaction"].default is True
    assert OPDConfig.__dataclass_fields__["decode_compile"].default is False
    model = small_vocab_model()
    ps = rows()
    tr = stub_trainer(model, N)
    tr.generation_config.eos_token_id, tr.eos_token_ids, tr._tokenizer.pad_token_id = EOS, EOS, PAD
    tr.args.decode_compaction = True
    got = fast_generate_single_turn(tr, ps)
    gen = model._opd_fast_generator
    assert gen.compaction and not gen.compile_step
    assert got == hf_greedy(model, ps, N, PAD, EOS)
    tr.args.decode_compaction = False
    fast_generate_single_turn(tr, ps)
    assert model._opd_fast_generator is not gen and not model._opd_fast_generator.compaction


def test_decode_bench_lengths_floor_and_warmup():
    import statistics
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import decode_bench as db

    n = db.draw_lengths(128, 1500.0, 8192, 0.06, seed=2)
    assert statistics.median(n) == 1500 and sum(x == 8192 for x in n) == 8 and min(n) >= 1
    assert n != sorted(n) and sorted(n) == sorted(db.draw_lengths(128, 1500.0, 8192, 0.06, seed=3))
    # two rows, prompts 2 and 3 tokens, lengths 2 and 4: steps 1..3; live KV (2+1)+(3+1), (3+2), (3+3)
    assert db.floor_bytes([2, 3], [2, 4], weight_bytes=100, kv_token_bytes=10) == (3, 3 * 100 + 10 * (7 + 5 + 6))
    wl, cap = db.warmup_lengths(128, 128)
    assert len(wl) == 128 and cap > max(wl)
    live = [sum(x > t for x in wl) for t in (128, 256, 384, 512)]
    assert live == [64, 32, 16, 8]
