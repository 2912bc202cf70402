"""async_generation (trainers.async_rollouts): one-step off-policy decode on a weight snapshot, on CPU.

Tiny models of tests/test_trainer.py. Greedy decoding (``do_sample=False``) so a completion is a function of
the weights alone and can be checked against a synchronous decode from a saved state dict.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.test_trainer import curriculum_path, make_trainer, tiny_model, tokenizer  # noqa: F401 - fixtures

GREEDY = {"do_sample": False}
THREAD = "opd-async-generation"


class _Weights(TrainerCallback):
    """The student's weights at each step's start, by ``global_step`` (= optimizer steps in them)."""

    def __init__(self, model):
        self.model, self.at = model, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _record_batches(tr) -> list[tuple[int, dict]]:
    rec = []
    orig = tr._generate_and_score_completions

    def spy(inputs):
        out = orig(inputs)
        rec.append((tr.state.global_step, {k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)}))
        return out

    tr._generate_and_score_completions = spy
    return rec


def _ref_logp(tokenizer, state_dict, out, temperature):
    """``(B, K)`` plain full-logits log-probs of the completion tokens under ``state_dict`` (0 where masked)."""
    m = tiny_model(tokenizer).to(out["prompt_ids"].device)
    m.load_state_dict(state_dict)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    K = out["completion_ids"].size(1)
    with torch.no_grad():
        z = m(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1].float() / temperature
    lp = torch.log_softmax(z, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return lp * out["completion_mask"]


def test_prefetch_uses_previous_weights_and_is_weights_match_reference(tmp_path, tokenizer, curriculum_path):
    """Step k+1's completions are the greedy decode of theta_{k-1} (behaviour_step = k-1), the recorded
    behaviour log-probs are theta_{k-1}'s, and the loss's IS weights are min(exp(logp_theta_k - logp_beh), cap)."""
    _check_prefetch(tmp_path, tokenizer, curriculum_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_on_cuda_side_stream(tmp_path, tokenizer, curriculum_path):
    """The same on CUDA: decode in the worker thread on a side stream, its CUDA graph captured there
    (thread_local capture) while the main thread trains; reference decodes on the main stream."""
    _check_prefetch(tmp_path, tokenizer, curriculum_path, use_cpu=False)


def _check_prefetch(tmp_path, tokenizer, curriculum_path, **kw):
    from data_tools.generation.fast_decoder import FastGenerator, sampling_params_from

    cap = 1.0  # truncation active on about half the tokens: both branches of the min are checked
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, async_generation=True, fast_generation=True,
                      generation_kwargs=GREEDY, debug_max_steps=3, vllm_importance_sampling_cap=cap, **kw)
    model = tr.accelerator.unwrap_model(tr.model)
    weights = _Weights(model)
    tr.add_callback(weights)
    batches = _record_batches(tr)
    seen = []
    orig_is = tr._rollout_is_weights

    def spy_is(old, inputs, valid):
        w = orig_is(old, inputs, valid)
        seen.append((tr.state.global_step, inputs["rollout_index"].clone(), valid.clone(), w.clone()))
        return w

    tr._rollout_is_weights = spy_is
    tr.train()
    assert tr.state.global_step == 3
    import pyarrow.parquet as pq

    beh = [sorted({r["behaviour_step"] for r in pq.read_table(Path(tr.args.rollouts_dir) / f"step-{s:06d}.parquet")
                   .to_pylist()}) for s in (1, 2, 3)]
    assert beh == [[0], [0], [1]]  # step 1 decoded synchronously; then one step behind

    sp = sampling_params_from(tr.generation_config)
    gen = FastGenerator(tokenizer.pad_token_id, tr.eos_token_ids)
    checked_is = 0
    for step, out in batches:
        version = step if step == 0 else step - 1
        ref = tiny_model(tokenizer).to(out["prompt_ids"].device)
        ref.load_state_dict(weights.at[version])
        prompts = [p[m.bool()].tolist() for p, m in zip(out["prompt_ids"], out["prompt_mask"])]
        expect = gen.generate(ref, prompts, sp)
        got = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
        assert got == expect, f"step {step + 1}: completions are not theta_{version}'s"

        cmask = out["completion_mask"].bool()
        lp_beh = _ref_logp(tokenizer, weights.at[version], out, tr.temperature)
        torch.testing.assert_close(out["sampling_logps"][cmask], lp_beh[cmask], rtol=0, atol=2e-5)
        lp_cur = _ref_logp(tokenizer, weights.at[step], out, tr.temperature)
        if step >= 1:  # the lag is real: behaviour and current policies differ on these tokens
            assert (lp_cur - lp_beh)[cmask].abs().max() > 1e-3
        ref_w = torch.exp(lp_cur - lp_beh).clamp(max=cap)
        for s, idx, valid, w in seen:
            if s == step:
                torch.testing.assert_close(w, ref_w[idx][valid], rtol=1e-4, atol=1e-5)
                checked_is += 1
    lagged = torch.cat([w for s, _, _, w in seen if s >= 1])
    assert (lagged < cap - 1e-3).any() and (lagged == cap).any()  # both branches of the min were taken
    assert checked_is == 3 * tr.args.gradient_accumulation_steps
    assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())


def _trained(tr) -> list[list[str]]:
    import pyarrow.parquet as pq

    files = sorted(Path(tr.args.rollouts_dir).glob("step-*.parquet"))
    return [sorted(r["problem_id"] for r in pq.read_table(f).to_pylist()) for f in files]


def test_n_steps_train_n_batches_in_order_and_leave_no_thread(tmp_path, tokenizer, curriculum_path):
    """5 steps cross an epoch (4 batches of 2 prompts): the same batches, in the same order, as without async,
    each trained once; the epoch's first step decodes synchronously; no decode thread outlives train()."""
    sync = make_trainer(tmp_path / "sync", tokenizer, curriculum_path, fast_generation=True, generation_kwargs=GREEDY,
                        debug_max_steps=5)
    sync.train()
    tr = make_trainer(tmp_path / "async", tokenizer, curriculum_path, async_generation=True, fast_generation=True,
                      generation_kwargs=GREEDY, debug_max_steps=5)
    calls = []
    orig = tr._compute_loss
    tr._compute_loss = lambda *a, **k: (calls.append(tr.state.global_step), orig(*a, **k))[1]
    tr.train()
    assert tr.state.global_step == 5
    assert len(calls) == 5 * tr.args.gradient_accumulation_steps
    assert sorted(set(calls)) == [0, 1, 2, 3, 4]
    assert _trained(tr) == _trained(sync) and len(_trained(tr)) == 5
    import json

    recs = [json.loads(x) for x in tr.args.metrics_path.read_text().splitlines()]
    assert [r["async/staleness"] for r in recs] == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert all(r["async/overlap_s"] >= 0 and "sampling/importance_sampling_ratio/mean" in r for r in recs)
    assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())
    assert tr.rollouts.prefetch._job is None and tr.rollouts.prefetch._thread is None


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = control.should_save = True


def test_stop_cancels_the_prefetch(tmp_path, tokenizer, curriculum_path):
    """A stop between steps (deadline, signal) cancels the decode launched for the next step before the final
    save; the batch is never trained (2 rollout files), and train() leaves no thread."""
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, async_generation=True, fast_generation=True,
                      debug_max_steps=0)
    tr.add_callback(_StopAt(2))
    pending = []
    orig = tr.rollouts.prefetch.cancel
    tr.rollouts.prefetch.cancel = lambda: (pending.append(tr.rollouts.prefetch._job is not None), orig())[1]
    tr.train()
    assert tr.state.global_step == 2
    assert pending[0] is True  # step 3's prefetch was in flight (or done, not taken) at the stop
    assert len(_trained(tr)) == 2
    assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())


def test_generator_logprobs_match_plain_forward(tokenizer):
    """FastGenerator(return_logprobs=True) with sampling at T = 0.7: each token's log-prob is that of
    log_softmax(logits / T) of a plain forward of prompt + completion."""
    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams

    torch.manual_seed(0)
    m = tiny_model(tokenizer, seed=4)
    sp = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=50)
    prompts = [[1, 2, 3, 4], [5, 6], [5, 6]]
    ids, lps = FastGenerator(tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(m, prompts, sp,
                                                                                       return_logprobs=True)
    assert [len(x) for x in lps] == [len(x) for x in ids]
    for p, c, lp in zip(prompts, ids, lps):
        with torch.no_grad():
            z = m(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / 0.7
        ref = torch.log_softmax(z, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(lp), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kw, needle", [(dict(num_iterations=2, gradient_accumulation_steps=1,
                                               per_device_train_batch_size=8), "num_iterations"),
                                        (dict(fast_generation=False), "fast_generation"),
                                        (dict(sft_share_start=0.5), "sft_share")])
def test_unsupported_settings_are_refused(tmp_path, kw, needle):
    from tests.test_trainer import make_args

    with pytest.raises(ValueError, match=needle):
        make_args(tmp_path, async_generation=True, **kw)


def test_resume_trains_every_batch_once(tmp_path, tokenizer, curriculum_path):
    """Stopped after step 2 (its prefetch of step 3 dropped) and resumed to step 4: steps 1-4 trained the
    same batches as an uninterrupted synchronous run; the resumed run's first step decodes synchronously."""
    import json

    from trainers.callbacks import find_resume_checkpoint

    sync = make_trainer(tmp_path / "sync", tokenizer, curriculum_path, fast_generation=True, debug_max_steps=4)
    sync.train()
    a = make_trainer(tmp_path / "async", tokenizer, curriculum_path, async_generation=True, fast_generation=True,
                     debug_max_steps=0)
    a.add_callback(_StopAt(2))
    a.train()
    ckpt = find_resume_checkpoint(a.args.resume_dir)
    assert ckpt is not None and ckpt.endswith("checkpoint-2")
    b = make_trainer(tmp_path / "async", tokenizer, curriculum_path, async_generation=True, fast_generation=True,
                     debug_max_steps=4)
    b.train(resume_from_checkpoint=ckpt)
    assert b.state.global_step == 4
    assert _trained(b) == _trained(sync) and len(_trained(b)) == 4
    recs = [json.loads(x) for x in b.args.metrics_path.read_text().splitlines()]
    assert [(r["step"], r["async/staleness"]) for r in recs] == [(1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)]
    assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())


def test_snapshot_runs_its_own_weights(tokenizer):
    """``make_snapshot`` drops instance-level forwards bound to the original layers (as compile_decoder_layers
    installs): after the original's weights change, the snapshot still computes with its copied ones."""
    from trainers.async_rollouts import make_snapshot

    m = tiny_model(tokenizer, seed=5)
    fn = type(m.model.layers[0]).forward
    for layer in m.model.layers:  # the shape of compile_decoder_layers' wrapper, minus the compile
        layer.forward = lambda *a, _layer=layer, **k: fn(_layer, *a, **k)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = m(input_ids=ids).logits
        snap = make_snapshot(m)
        for p in m.model.layers.parameters():
            p.mul_(0.5)
        after = m(input_ids=ids).logits
        assert not torch.allclose(before, after)
        torch.testing.assert_close(snap(input_ids=ids).logits, before)
    assert not any(p.requires_grad for p in snap.parameters()) and not snap.training


def test_device_synchronize_waits_for_a_capture(monkeypatch):
    """``guard_device_synchronize``: each device-wide synchronize (``torch.cuda.synchronize``, dynamo's
    ``CudaInterface.synchronize`` that inductor's benchmarker calls in torch 2.13, ``torch.accelerator.synchronize``)
    called from another thread blocks while the worker holds ``CAPTURE_LOCK`` (a capture in progress) and runs once
    it is released; the worker's own call inside the lock passes (re-entrant); guarding twice wraps once. The CUDA
    calls are replaced by recorders here."""
    import trainers.async_rollouts as ar
    from torch._dynamo.device_interface import CudaInterface

    calls = []

    def recorder(what):
        return lambda *a, **k: calls.append((what, threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "synchronize", recorder("cuda"))
    monkeypatch.setattr(CudaInterface, "synchronize", staticmethod(recorder("dynamo")))
    monkeypatch.setattr(torch.accelerator, "synchronize", recorder("accelerator"))
    ar.guard_device_synchronize()
    guarded = (torch.cuda.synchronize, CudaInterface.synchronize, torch.accelerator.synchronize)
    ar.guard_device_synchronize()
    assert (torch.cuda.synchronize, CudaInterface.synchronize, torch.accelerator.synchronize) == guarded
    assert all(g._opd_unguarded is not None for g in guarded)

    for what, sync in (("cuda", lambda: torch.cuda.synchronize()), ("dynamo", lambda: CudaInterface.synchronize()),
                       ("accelerator", lambda: torch.accelerator.synchronize())):
        calls.clear()
        held, release = threading.Event(), threading.Event()

        def capture(sync=sync):
            with ar.CAPTURE_LOCK:
                sync()  # the worker's own, inside its capture block
                held.set()
                release.wait(10)

        worker = threading.Thread(target=capture, name="capturer")
        worker.start()
        assert held.wait(10)
        main = threading.Thread(target=sync, name="trainer")
        main.start()
        main.join(0.3)
        assert main.is_alive() and calls == [(what, "capturer")], what  # waiting for the capture to end
        release.set()
        main.join(10)
        worker.join(10)
        assert not main.is_alive() and calls == [(what, "capturer"), (what, "trainer")], what


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_step", [False, True])
def test_capture_survives_device_synchronize_from_the_main_thread(tokenizer, compile_step):
    """RESULTS.md run 10: inductor's autotuning called ``torch.cuda.synchronize()`` in the main thread while the
    worker captured a decode graph ("operation not permitted when stream is capturing"). Here the main thread
    synchronizes the device in a loop while the worker decodes with compaction (a capture per new window), with and
    without ``decode_compile`` (the worker compiles each new batch bucket outside the lock); the completions must
    equal a synchronous greedy decode of the same weights."""
    from trainers.async_rollouts import AsyncRollouts
    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams

    model = tiny_model(tokenizer, seed=3).cuda()
    sp = SamplingParams(max_new_tokens=300, temperature=1.0, top_p=1.0, top_k=0, do_sample=False)
    prompts = [[1 + (i * 7 + j) % 50 for j in range(5 + i % 4)] for i in range(24)]
    ar = AsyncRollouts(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], compaction=True, attn_bucket=16,
                       compile_step=compile_step)
    ar.launch(model, prompts, sp, version=0)
    x = torch.randn(256, 256, device="cuda")
    n = 0
    while ar.busy:
        x = (x @ x).tanh()
        torch.cuda.synchronize()
        n += 1
    job = ar.take(prompts)
    expect = FastGenerator(tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(model, prompts, sp)
    assert n > 0 and job is not None and job.completions == expect
    assert ar.generator.stats.get("graphs", 0) >= 2


def test_snapshot_in_another_dtype_is_built_without_a_full_copy_first(tokenizer, monkeypatch):  # noqa: F811
    """make_snapshot(model, bf16) of an fp32 model: bf16 parameters (tied ones still tied), fp32 buffers, nothing shared
    with the model, and no parameter deep-copied in fp32 on the way (copying the fp32 model whole and casting after
    held both copies at once: ~7 GB more at the peak for a 1.78B student instead of 3.6)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.fast_generation import make_snapshot

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    copied = []
    real = torch.nn.Parameter.__deepcopy__
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", lambda self, memo: (copied.append(self.dtype), real(self, memo))[1])
    snap = make_snapshot(model, torch.bfloat16)
    assert copied == []  # every parameter came from the memo, already bf16
    assert {p.dtype for p in snap.parameters()} == {torch.bfloat16}
    assert snap.lm_head.weight is snap.model.embed_tokens.weight  # tied
    assert {b.dtype for b in snap.buffers() if b.is_floating_point()} == {torch.float32}
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in snap.parameters()}
    for (n, p), q in zip(model.named_parameters(), snap.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16)), n
    same = make_snapshot(model)  # no dtype: the parameters' own, still copies
    assert {p.dtype for p in same.parameters()} == {torch.float32} and copied == []
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in same.parameters()}
