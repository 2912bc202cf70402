"""trainers.guards and data_tools.generation.fallback: a broken vLLM colocate probe and a failing compile fall back with one line each (CPU).

vLLM colocate cannot run on a CPU, so the probe's engine is a stand-in with TRL's ``VLLMGeneration`` contract
(``max_completion_length``, ``logprobs``, ``sync_weights``, ``generate`` returning prompt ids, completion ids and
per-token ``[log-prob]`` lists): one that raises, one whose log-probs disagree with the trainer's forward by 1 nat,
and one that agrees (the probe passes and vLLM stays on).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.test_trainer import curriculum_path, make_trainer, tokenizer, tiny_model  # noqa: F401 - fixtures
from data_tools.generation import fallback
from trainers import guards, rollout_source


@pytest.fixture(autouse=True)
def _fresh_lines():
    fallback._said.clear()
    yield
    fallback._said.clear()


def _lines(caplog, name="data_tools.generation.fallback"):
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno >= logging.WARNING]


class _VLLM:
    """``VLLMGeneration`` stand-in: ``mode`` raise | disagree | agree."""

    def __init__(self, trainer, mode):
        self.trainer, self.mode = trainer, mode
        self.max_completion_length, self.logprobs = 6, None
        self.synced, self.seen_max = 0, []
        self.llm = object()

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        self.seen_max.append((self.max_completion_length, self.logprobs))
        if self.mode == "raise":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        g = torch.Generator().manual_seed(0)
        cids = [torch.randint(0, len(self.trainer.processing_class), (5,), generator=g).tolist() for _ in prompts]
        # the trainer's own log-probs of these tokens (what a correct engine reports), then the mode's error
        from trainers.trl_compat import pad

        p = [torch.tensor(x) for x in prompts]
        c = [torch.tensor(x) for x in cids]
        out = {"prompt_ids": pad(p, padding_value=0, padding_side="left"),
               "prompt_mask": pad([torch.ones_like(x) for x in p], padding_value=0, padding_side="left"),
               "completion_ids": pad(c, padding_value=0, padding_side="right"),
               "completion_mask": pad([torch.ones_like(x) for x in c], padding_value=0, padding_side="right")}
        own = self.trainer._policy_logps(out)
        shift = 1.0 if self.mode == "disagree" else 0.01
        lps = [[[float(own[i, j]) + shift] for j in range(len(cids[i]))] for i in range(len(cids))]
        return prompts, cids, lps, None


def _as_vllm_trainer(tr, mode):
    """A CPU trainer turned into one that was built with use_vllm colocate (the probe's inputs)."""
    tr.use_vllm = tr.args.use_vllm = True
    tr.args.vllm_mode = "colocate"
    tr.vllm_generation = _VLLM(tr, mode)
    tr.rollouts = rollout_source.VLLM(tr, is_weights=True)  # "vllm-colocate", with the engine's log-probs
    tr._last_loaded_step = -1  # what TRL's __init__ sets with use_vllm
    return tr.vllm_generation


def _guard(tr):
    """The start-up guard of vLLM colocate, as ``rollout_source.choose`` runs it: the probe, else the fallback."""
    tr.rollouts = tr.rollouts.probed(tr)


@pytest.mark.parametrize("mode,why", [("raise", "raised RuntimeError: CUDA error: an illegal memory access"),
                                      ("disagree", "log-probs disagree with the trainer's: mean |difference| 1 ")])
def test_broken_vllm_probe_falls_back_with_one_line_and_trains(tmp_path, tokenizer, curriculum_path, caplog, mode,
                                                               why):
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, debug_max_steps=2)
    vg = _as_vllm_trainer(tr, mode)
    with caplog.at_level(logging.WARNING):
        _guard(tr)
    lines = _lines(caplog)
    assert len(lines) == 1, lines
    assert why in lines[0] and "generating with the fast decoder" in lines[0] and "\n" not in lines[0]
    assert vg.synced == 1 and vg.seen_max == [(guards.PROBE_TOKENS, 0)]  # the probe's size, then restored
    assert (vg.max_completion_length, vg.logprobs) == (6, None)
    assert vg.llm is None and not hasattr(tr, "vllm_generation")  # the engine is released
    assert (tr.use_vllm, tr.args.use_vllm, tr.rollouts.is_weights) == (False, False, False)
    assert type(tr.rollouts) is rollout_source.FastDecoder and tr.rollouts.name == "hf-generate-fast"
    tr.train()
    assert tr.state.global_step == 2
    assert hasattr(tr.accelerator.unwrap_model(tr.model), "_opd_fast_generator")  # the fast decoder generated
    assert len(_lines(caplog)) == 1


def test_vllm_failing_mid_run_falls_back_to_the_fast_decoder_and_the_run_goes_on(tmp_path, tokenizer, curriculum_path,
                                                                                    caplog):
    """A vLLM that passed its probe and fails at a later step (the formal image's untested 0.17 on a B300): one line
    naming the step and the error, the engine released, the step generated by the fast decoder, training goes on."""
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, debug_max_steps=3)
    vg = _as_vllm_trainer(tr, "agree")
    _guard(tr)
    assert tr.use_vllm
    real = vg.generate

    def flaky(prompts, images, num_generations, profiler=None):
        if tr.state.global_step >= 1:  # step 0 generates with vLLM; the next one fails
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return real(prompts, images, num_generations, profiler)

    vg.generate = flaky
    with caplog.at_level(logging.WARNING):
        tr.train()
    lines = _lines(caplog)
    assert tr.state.global_step == 3 and len(lines) == 1, lines
    assert lines[0].startswith("use_vllm: vLLM failed at step 1 (RuntimeError: CUDA error: an illegal memory access")
    assert "generating with the fast decoder" in lines[0]
    assert not tr.use_vllm and tr.rollouts.name == "hf-generate-fast" and vg.llm is None
    assert hasattr(tr.accelerator.unwrap_model(tr.model), "_opd_fast_generator")


def test_agreeing_vllm_probe_keeps_vllm(tmp_path, tokenizer, curriculum_path, caplog):
    tr = make_trainer(tmp_path, tokenizer, curriculum_path)
    vg = _as_vllm_trainer(tr, "agree")
    with caplog.at_level(logging.WARNING):
        _guard(tr)
    assert _lines(caplog) == [] and tr.use_vllm and tr.rollouts.is_weights and tr.vllm_generation is vg
    tr.args.vllm_probe_tolerance = 0.005  # the stand-in's 0.01 nats/token is now too much
    with caplog.at_level(logging.WARNING):
        _guard(tr)
    assert len(_lines(caplog)) == 1 and "0.01 nats/token" in _lines(caplog)[0] and not tr.use_vllm


def test_use_vllm_where_vllm_cannot_run_starts_on_the_fast_decoder(tmp_path, tokenizer, curriculum_path, caplog,
                                                                    monkeypatch):
    """use_vllm on a machine without vLLM colocate (no CUDA, no vllm, or an old TRL): one warning, use_vllm off before
    the base trainer builds an engine, and the rollout source is the fast decoder; without use_vllm, on a CPU, TRL's
    HF generate."""
    monkeypatch.setattr(rollout_source, "vllm_usable", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        tr = make_trainer(tmp_path, tokenizer, curriculum_path, use_vllm=True)
    said = [r.getMessage() for r in caplog.records if "use_vllm is set" in r.getMessage()]
    assert len(said) == 1 and not tr.use_vllm and not tr.args.use_vllm
    assert type(tr.rollouts) is rollout_source.FastDecoder and tr.rollouts.name == "hf-generate-fast"
    plain = make_trainer(tmp_path / "plain", tokenizer, curriculum_path)
    assert type(plain.rollouts) is rollout_source.HFGenerate and plain.rollouts.name == "hf-generate"


def test_probe_tolerance_zero_means_no_probe(tmp_path, tokenizer, curriculum_path):
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, vllm_probe_tolerance=0.0)
    vg = _as_vllm_trainer(tr, "raise")
    _guard(tr)
    assert vg.seen_max == [] and tr.use_vllm
    with pytest.raises(ValueError, match="vllm_probe_tolerance"):
        make_trainer(tmp_path, tokenizer, curriculum_path, vllm_probe_tolerance=-1.0)


# ---------------------------------------------------------------- compilation


def _raising_compile(kind):
    def compile_(fn, **kw):
        if kind == "at_compile":
            raise RuntimeError("Dynamo is not supported on this Python")

        def compiled(*a, **k):
            if kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory")
            raise RuntimeError("BackendCompilerFailed: inductor raised\ntraceback")
        return compiled
    return compile_


def _pair(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    a = LlamaForCausalLM(cfg)
    b = LlamaForCausalLM(cfg)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("kind,what", [("at_compile", "torch.compile failed (RuntimeError: Dynamo is not supported"),
                                       ("first_call", "the compiled function failed (RuntimeError: BackendCompilerFailed")])
def test_failing_compile_layers_falls_back_to_eager_with_one_line(tokenizer, monkeypatch, caplog, kind, what):
    from trainers.model_utils import compile_decoder_layers

    model, ref = _pair(tokenizer)
    monkeypatch.setattr(torch, "compile", _raising_compile(kind))
    with caplog.at_level(logging.WARNING):
        assert compile_decoder_layers(model, only_with_grad=False)
        ids = torch.randint(0, 64, (2, 7))
        for _ in range(3):  # every layer, every call: eager, and still one line
            out = model(ids).logits
    assert torch.equal(out, ref(ids).logits)
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("compile_layers: ") and what in lines[0], lines
    assert "running eagerly" in lines[0] and "\n" not in lines[0]
    out.sum().backward()  # the training path (gradients) runs eagerly too
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_failing_decode_compile_falls_back_to_eager_with_one_line(tokenizer, monkeypatch, caplog):
    from data_tools.generation.kv_cache import decode_layers_compiled

    model, ref = _pair(tokenizer)
    monkeypatch.setattr(torch, "compile", _raising_compile("first_call"))
    ids = torch.randint(0, 64, (2, 5))
    with caplog.at_level(logging.WARNING), torch.no_grad():
        for _ in range(2):
            with decode_layers_compiled(model, 2):
                out = model(ids).logits
    assert torch.equal(out, ref(ids).logits)
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("decode_compile: the compiled function failed"), lines
    assert "forward" not in model.model.layers[0].__dict__  # the layers' own forward is back after the block


def test_out_of_memory_in_compiled_code_is_not_hidden(tokenizer, monkeypatch, caplog):
    from trainers.model_utils import compile_decoder_layers

    model, _ = _pair(tokenizer)
    monkeypatch.setattr(torch, "compile", _raising_compile("oom"))
    compile_decoder_layers(model, only_with_grad=False)
    with pytest.raises(torch.OutOfMemoryError):
        model(torch.randint(0, 64, (1, 4)))
    assert _lines(caplog) == []


def test_compiled_layers_under_activation_checkpointing_backpropagate(tokenizer, monkeypatch, caplog):
    """Non-reentrant checkpointing stops a layer's recompute early by raising inside it; the compile guard lets that
    through. Taking it for a compile error crashed the first backward of the formal rehearsal on an H200 (2026-12-05:
    "Unexpected state: target_frame.early_stop is set")."""
    from trainers.model_utils import compile_decoder_layers

    model, ref = _pair(tokenizer)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # a compile that works: the eager function itself
    for m in (model, ref):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert compile_decoder_layers(model, only_with_grad=True)
    ids = torch.randint(0, 64, (2, 9))
    with caplog.at_level(logging.WARNING):
        model(ids).logits.float().pow(2).mean().backward()
    ref(ids).logits.float().pow(2).mean().backward()
    assert _lines(caplog) == []  # no fallback: the guard saw no compile error
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_trainer_with_a_failing_compile_steps(tmp_path, tokenizer, curriculum_path, monkeypatch, caplog):
    import trainers.trl_compat  # noqa: F401 - TRL's trainer imported before the patch: vLLM compiles at import
    monkeypatch.setattr(torch, "compile", _raising_compile("first_call"))
    with caplog.at_level(logging.WARNING):
        tr = make_trainer(tmp_path, tokenizer, curriculum_path, compile_layers=True, debug_max_steps=2)
        tr.train()
    assert tr.state.global_step == 2
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("compile_layers: the compiled function failed"), lines
