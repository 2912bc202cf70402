"""CPU tests of the fast decoder (``data_tools.generation``) on a tiny random Qwen2: contract and greedy equality with
HF generate."""

from __future__ import annotations

import pytest
import torch

from data_tools.generation.fast_decoder import (FastGenerator, SamplingParams, group_runs, sample_next,
                                                sampling_params_from)
from data_tools.generation.kv_cache import gqa_decode_attention


def tiny_model(attn="sdpa", seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation=attn)
    m = Qwen2ForCausalLM(cfg).float().eval()
    return m


def prompts(seed=1, n=5, lo=3, hi=11, vocab=90):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(3, vocab, (k,), generator=g).tolist())
    return out


def hf_greedy(model, ps, N, pad, eos):
    """TRL's HF path: left pad, generate, cut after the first EOS (kept)."""
    P = max(map(len, ps))
    ids = torch.full((len(ps), P), pad)
    mask = torch.zeros(len(ps), P, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, do_sample=False,
                         pad_token_id=pad, eos_token_id=eos)[:, P:]
    res = []
    for row in out.tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        res.append(row[:cut])
    return res


@pytest.mark.parametrize("attn,gqa", [("sdpa", True), ("sdpa", False), ("eager", True)])
def test_greedy_matches_hf_generate(attn, gqa):
    model = tiny_model(attn)
    ps = prompts()
    pad, eos = 0, [1]
    ref = hf_greedy(model, ps, 24, pad, eos)
    gen = FastGenerator(pad, eos, len_bucket=16, gqa_attention=gqa, check_every=4)
    got = gen.generate(model, ps, SamplingParams(max_new_tokens=24, do_sample=False))
    assert got == ref


def test_eos_cut_and_min_new_tokens():
    model = tiny_model()
    ps = prompts(n=4)
    # make the model's favourite first token the EOS so sequences finish early
    ref = hf_greedy(model, ps, 12, 0, [1])
    eos = [ref[0][0]]
    gen = FastGenerator(0, eos, len_bucket=8)
    got = gen.generate(model, ps, SamplingParams(max_new_tokens=12, do_sample=False))
    assert got == hf_greedy(model, ps, 12, 0, eos)
    assert got[0] == [eos[0]]  # cut right after the EOS, which is kept
    # min_new_tokens suppresses EOS, as HF's MinNewTokensLengthLogitsProcessor does
    got = gen.generate(model, ps, SamplingParams(max_new_tokens=12, min_new_tokens=12, do_sample=False))
    assert all(len(c) == 12 for c in got)
    assert all(eos[0] not in c for c in got)


def test_sampling_shapes_and_reuse():
    model = tiny_model()
    ps = [p for p in prompts(n=3) for _ in range(4)]  # G = 4 samples of each prompt in a row
    assert group_runs(ps) == [4, 4, 4]
    gen = FastGenerator(0, [1], len_bucket=32, keep_cache=True)
    sp = SamplingParams(max_new_tokens=10, min_new_tokens=10, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(0)
    a = gen.generate(model, ps, sp)
    b = gen.generate(model, ps, sp)  # second call reuses the static state
    assert gen.stats["captures"] == 1
    assert len(a) == len(ps) and all(len(c) == 10 for c in a + b)
    assert all(0 <= t < 97 for c in a for t in c)
    assert a != b  # fresh randomness per call
    assert model.training is False
    free = FastGenerator(0, [1], len_bucket=32)  # default: cache and graph freed after each call
    assert len(free.generate(model, ps, sp)) == len(ps) and free._state is None


def test_sample_next_respects_filters():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    eos = torch.tensor([3])
    sp = SamplingParams(max_new_tokens=1, top_k=5)
    top5 = logits.topk(5).indices
    for _ in range(5):
        nxt = sample_next(logits, sp, eos, torch.tensor(True))
        assert all(int(n) in top5[i].tolist() for i, n in enumerate(nxt))
    no_eos = sample_next(torch.zeros(256, 50), SamplingParams(max_new_tokens=1), eos, torch.tensor(False))
    assert (no_eos != 3).all()
    greedy = sample_next(logits, SamplingParams(max_new_tokens=1, do_sample=False), eos, None)
    assert torch.equal(greedy, logits.argmax(-1))


def test_gqa_decode_attention_matches_sdpa():
    torch.manual_seed(0)
    B, H, KVH, L, D = 3, 6, 2, 10, 8
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KVH, L, D), torch.randn(B, KVH, L, D)
    keep = torch.rand(B, 1, 1, L) > 0.3
    keep[..., 0] = True
    add = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    o, _ = gqa_decode_attention(None, q, k, v, add)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1), attn_mask=keep).transpose(1, 2)
    assert torch.allclose(o, ref, atol=1e-5)


def test_sampling_params_from_generation_config():
    from transformers import GenerationConfig

    # top_k given: transformers 4.57's GenerationConfig defaults it to 50, 5.x to None
    sp = sampling_params_from(GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.5, top_p=0.9,
                                               min_new_tokens=2, top_k=0))
    assert sp == SamplingParams(max_new_tokens=7, min_new_tokens=2, do_sample=True, temperature=0.5, top_p=0.9)
    assert sampling_params_from(GenerationConfig(max_new_tokens=7, repetition_penalty=1.2)) is None


def test_opd_trainer_routes_through_fast_path(tmp_path):
    """OPDTrainer(fast_generation=True) on a tiny random model: the bench's trainer run, 1 step, on CPU."""
    pytest.importorskip("trl")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import opd_step_bench as b

    out = tmp_path / "train.json"
    summary = b.main(["--device", "cpu", "--tiny", "--skip-bench", "--train-steps", "1", "--prompts", "4", "--G", "2",
                      "--prompt-len", "8", "--new-tokens", "6", "--train-json", str(out), "--grader-workers", "1"])
    assert summary["trainer"].startswith("OPDTrainer")
    (step,) = summary["steps"]
    assert step["engine"] == "hf-generate-fast"
    assert step["loss"] is not None
