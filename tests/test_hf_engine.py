"""The hf engine on CPU (tiny random Llama with SmolLM2's tokenizer): vLLM's Sample contract, and engine choice."""

from __future__ import annotations

import sys

import pytest

from tests.test_generation import hf_greedy
from tests.test_trainer import tiny_model, tokenizer  # noqa: F401 - fixture


@pytest.fixture()
def stop_model_dir(tokenizer, tmp_path):  # noqa: F811
    """A tiny model whose generation_config adds a second EOS: a greedy token of prompt 0 that prompt 1 never emits."""
    model = tiny_model(tokenizer, seed=5)
    texts = ["Question: what is 2 + 3? Answer:", "Count on: 7, 8, 9,"]  # the engine takes any rendered string
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # as the engine: rendered text
    g0, g1 = hf_greedy(model, ids, 10, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    stop = next(t for t in g0 if t not in g1)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    return str(tmp_path / "m"), texts, ids, model


def test_greedy_samples_match_hf_generate(stop_model_dir):
    from data_tools.generation.engines import HFEngine

    path, texts, ids, model = stop_model_dir
    eng = HFEngine(path, device="cpu", max_model_len=256)
    assert eng.name == "hf-cpu" and eng.dtype == "float32" and len(eng.eos_ids) == 2
    chunks = list(eng.generate(texts, n=2, max_tokens=10, temperature=0.0, chunk_size=1))
    assert [len(c) for c in chunks] == [2, 2]  # one list per chunk of prompts, n samples each
    got = [s for c in chunks for s in c]
    assert [(s.prompt_index, s.sample_index) for s in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref = hf_greedy(model.eval(), ids, 10, eng.tokenizer.pad_token_id, eng.eos_ids)
    for s in got:
        r = ref[s.prompt_index]
        stopped = r[-1] in eng.eos_ids
        assert s.n_tokens == len(r) and s.n_prompt_tokens == len(ids[s.prompt_index])
        assert s.finish_reason == ("stop" if stopped else "length")
        assert s.completion == eng.tokenizer.decode(r[:-1] if stopped else r, skip_special_tokens=True,
                                                    clean_up_tokenization_spaces=False)
    assert got[0].finish_reason == "stop" and got[0].n_tokens < 10
    assert eng.tokenizer.decode([eng.eos_ids[1]]) not in got[0].completion  # the stop token is not in the text
    assert got[2].finish_reason == "length" and got[2].n_tokens == 10  # a random model runs to the cap
    with pytest.raises(ValueError, match="exceed max_model_len 256"):
        list(eng.generate(texts, n=1, max_tokens=250))


def test_sampling_keeps_groups_and_batches(stop_model_dir):
    from data_tools.generation.engines import HFEngine

    path, texts, _, _ = stop_model_dir
    eng = HFEngine(path, device="cpu", max_model_len=256, max_batch=3)  # 3 // n=2: one prompt per decode call
    got = [s for c in eng.generate(texts * 2, n=2, max_tokens=6, temperature=1.0, top_p=0.9, chunk_size=4) for s in c]
    assert [(s.prompt_index, s.sample_index) for s in got] == [(i, j) for i in range(4) for j in range(2)]
    assert all(1 <= s.n_tokens <= 6 for s in got)
    assert all(s.n_tokens == 6 for s in got if s.finish_reason == "length")
    assert eng.max_batch == 3


def test_make_engine_choice(monkeypatch, stop_model_dir):
    from data_tools.generation import engines as E

    with pytest.raises(ValueError, match="engine must be one of"):
        E.make_engine("sglang", "x")
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError: auto falls back to hf
    eng = E.make_engine("auto", stop_model_dir[0], seed=0, max_model_len=128, tensor_parallel_size=1)
    assert eng.name in ("hf-cpu", "hf-cuda")


def test_engine_field_validated():
    from stages.curate import CurateConfig
    from stages.evaluate import EvalConfig

    with pytest.raises(ValueError, match="engine must be one of"):
        CurateConfig(output_dir="/tmp/x", engine="tgi")
    with pytest.raises(ValueError, match="engine must be one of"):
        EvalConfig(engine="tgi")
    assert CurateConfig(output_dir="/tmp/x").engine == EvalConfig().engine == "auto"


def test_engine_settings_are_declared_once_with_the_same_flags_and_keys(tmp_path):
    """``EngineSettings`` holds the engine's settings of stage one and evaluation: both configs inherit its fields
    (not copies), take the same flags and YAML keys, and hand the same keyword arguments to ``make_engine``."""
    from dataclasses import fields

    from data_tools.config import parse_config
    from data_tools.generation.engines import EngineSettings
    from stages.curate import CurateConfig
    from stages.evaluate import EvalConfig

    shared = ["engine", "dtype", "gpu_memory_utilization", "tensor_parallel_size", "vllm_request_seeds"]
    assert [f.name for f in fields(EngineSettings)] == shared
    for cls in (CurateConfig, EvalConfig):
        assert all(cls.__dataclass_fields__[n] is EngineSettings.__dataclass_fields__[n] for n in shared)
    out = ["--output_dir", str(tmp_path / "run")]
    flags = ["--engine", "hf", "--dtype", "float32", "--gpu_memory_utilization", "0.5", "--tensor_parallel_size", "2",
             "--vllm_request_seeds", "false"]
    want = {"dtype": "float32", "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2, "request_seeds": False}
    (c,) = parse_config([CurateConfig], flags + out, env={})
    (e,) = parse_config([EvalConfig], flags, env={})
    assert c.engine == e.engine == "hf" and c.engine_kwargs() == e.engine_kwargs() == want
    yml = tmp_path / "engine.yaml"
    yml.write_text("engine: hf\ndtype: float32\ngpu_memory_utilization: 0.5\ntensor_parallel_size: 2\n"
                   "vllm_request_seeds: false\n")
    (c,) = parse_config([CurateConfig], ["--config", str(yml)] + out, env={})
    (e,) = parse_config([EvalConfig], ["--config", str(yml)], env={})
    assert c.engine == e.engine == "hf" and c.engine_kwargs() == e.engine_kwargs() == want
    assert CurateConfig(output_dir=str(tmp_path / "run")).engine_kwargs() == EvalConfig().engine_kwargs() == {
        "dtype": "auto", "gpu_memory_utilization": 0.85, "tensor_parallel_size": 1, "request_seeds": True}
    for bad, msg in (({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
                     ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
                     ({"dtype": "fp8"}, "dtype must be auto, float32 or bfloat16, got 'fp8'")):
        for make in (lambda: CurateConfig(output_dir=str(tmp_path / "run"), **bad), lambda: EvalConfig(**bad)):
            with pytest.raises(ValueError, match=msg):
                make()


def test_a_call_in_flight_stops_at_its_deadline_keeping_the_finished_samples(stop_model_dir, monkeypatch):
    """``generate(stop_at=...)``: the decoder's stop_event (``StopAt``) ends the call at its next check; samples that
    had ended in an EOS are kept, those still decoding dropped, and no decode call starts after it."""
    from data_tools.generation import engines
    from data_tools.generation.engines import HFEngine

    path, texts, _, _ = stop_model_dir
    checks = []

    class StopSecondCheck(engines.StopAt):  # the deadline passes between the decoder's first and second check
        def is_set(self):
            checks.append(self.at)
            return self.at is not None and len(checks) > 2  # 1: before the decode call; 2: step 32; 3: step 64

    monkeypatch.setattr(engines, "StopAt", StopSecondCheck)
    eng = HFEngine(path, device="cpu", max_model_len=512, max_batch=4)
    assert eng.interruptible
    # greedy: prompt 0 ends with its stop token within 10 tokens, prompt 1 would run to the 400-token cap
    got = [s for c in eng.generate(texts * 2, n=2, max_tokens=400, temperature=0.0, chunk_size=2, stop_at=1.0) for s in c]
    assert [(s.prompt_index, s.sample_index) for s in got] == [(0, 0), (0, 1)]  # prompt 1 dropped; prompts 2, 3 never run
    assert all(s.finish_reason == "stop" and s.n_tokens < 10 for s in got)
    assert eng.generator.last["stopped"] and eng.generator.last["unfinished"] == [2, 3]
    assert eng.generator.stop_event is None  # the engine's next call runs without it
    checks.clear()
    whole = [s for c in eng.generate(texts, n=1, max_tokens=40, temperature=0.0) for s in c]  # no deadline: as before
    assert [s.finish_reason for s in whole] == ["stop", "length"] and set(checks) == {None}
    import time

    assert [s for c in eng.generate(texts, n=1, max_tokens=40, stop_at=time.time() - 1) for s in c] == []
