"""Regime (iii)'s machinery of bench/learning.py (bench/learning/run-3-plan.md): the cut student, the reverse-KL
probe, the problems files and the unseen arm problems, the time schedule's window, the +kl / +ep run names, the
setup's gate lines and the report's contrasts. Each value is checked against a plain reference computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.learning_config import ARM_SPECS, PRESETS, LearningConfig
from bench.learning_setup import cut_layers, cut_model, kept_layers, reverse_kl_probe, reverse_kl_sums
from data_tools.runio import write_parquet

# ------------------------------------------------------------------------------------------- the cut student


def test_kept_layers_spreads_evenly_and_keeps_both_ends():
    # the plan's cut: 12 of SmolLM2-135M's 30 layers, round-half-up of i * 29 / 11
    want = [int(math.floor(i * 29 / 11 + 0.5)) for i in range(12)]
    assert want == [0, 3, 5, 8, 11, 13, 16, 18, 21, 24, 26, 29]
    assert kept_layers(30, 12) == want == kept_layers(30, 12, "even")
    for total in (2, 6, 30):
        for keep in range(1, total + 1):
            got = kept_layers(total, keep)
            assert len(got) == keep and got == sorted(set(got)), (total, keep)  # distinct, in order
            assert got[-1] == total - 1, (total, keep)  # the last layer feeds the final norm and the head
            if keep > 1:
                assert got[0] == 0, (total, keep)
    assert kept_layers(30, 30) == list(range(30))
    assert kept_layers(30, 1) == [29] and kept_layers(6, 2) == [0, 5] and kept_layers(6, 3) == [0, 3, 5]
    assert kept_layers(30, 4, "first") == [0, 1, 2, 3] and kept_layers(5, 5, "first") == list(range(5))
    for bad, match in (((30, 0), "1 to 30"), ((30, 31), "1 to 30"), ((4, -1), "1 to 4")):
        with pytest.raises(ValueError, match=match):
            kept_layers(*bad)
    with pytest.raises(ValueError, match="'even' or 'first'"):
        kept_layers(30, 12, "last")


def _tiny_config(kind: str, vocab: int, layers: int = 6, **kw):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    # a large init spread: a random model whose greedy continuations are not one token repeated
    return cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, **kw)


def _tiny_model(kind: str, vocab: int, seed: int, layers: int = 6, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_tiny_config(kind, vocab, layers, **kw)).eval()


def _smol_tokenizer():
    from transformers import AutoTokenizer

    from data_tools.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None))


def _hand_forward(model, layer_ids: list[int], ids):
    """Logits of ``model``'s embedding, then only its decoder layers ``layer_ids`` in that order, the final norm and
    the head, called one by one with an explicit causal mask (no HF model-level forward)."""
    import torch

    T = ids.shape[1]
    pos = torch.arange(T).unsqueeze(0)
    h = model.model.embed_tokens(ids)
    rope = model.model.rotary_emb(h, pos)
    mask = torch.full((T, T), torch.finfo(h.dtype).min).triu(1)[None, None]
    for i in layer_ids:
        out = model.model.layers[i](h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(model.model.norm(h))


def _greedy_without_cache(model, ids, n: int):
    import torch

    x = ids
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(input_ids=x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cut_model_saves_the_kept_layers_and_generates(tmp_path, kind):
    """A tiny random model saved with SmolLM2's tokenizer, cut to 3 of 6 layers: the folder loads with transformers,
    holds 3 layers whose weights are the source's layers 0, 3, 5, computes the logits of a hand-built forward through
    those layers, and its cached greedy generate equals a greedy loop without a cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = _smol_tokenizer()
    src = tmp_path / "src"
    model = _tiny_model(kind, len(tok), 0, tie_word_embeddings=kind == "llama")
    model.save_pretrained(src)
    tok.save_pretrained(src)
    kept = cut_model(src, tmp_path / "cut", 3)
    assert kept == [0, 3, 5]
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    cut = AutoModelForCausalLM.from_pretrained(tmp_path / "cut", dtype=torch.float32, attn_implementation="eager").eval()
    cfg = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["cut_from_layers"] == [0, 3, 5]
    assert len(cut.model.layers) == 3 and [l.self_attn.layer_idx for l in cut.model.layers] == [0, 1, 2]
    if kind == "qwen2":
        assert cfg["layer_types"] == ["full_attention"] * 3
    src_sd, cut_sd = ref.state_dict(), cut.state_dict()
    for k, v in cut_sd.items():  # every weight is the source's, layer i taken from layer kept[i]
        parts = k.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(kept[int(parts[2])])
        assert torch.equal(v, src_sd[".".join(parts)]), k
    assert sum(k.startswith("model.layers.") for k in cut_sd) * 2 == sum(k.startswith("model.layers.") for k in src_sd)
    assert AutoTokenizer.from_pretrained(tmp_path / "cut").get_vocab() == tok.get_vocab()
    ids = torch.randint(3, len(tok), (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = cut(input_ids=ids).logits
        want = _hand_forward(ref, kept, ids)
        whole = _hand_forward(ref, list(range(6)), ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, whole, atol=1e-3)  # the cut changed the model: the comparison can fail
    with torch.no_grad():
        gen = cut.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=12,
                           do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=-1)
    assert gen.tolist() == _greedy_without_cache(cut, ids[:1], 12).tolist()
    assert len(set(gen[0, 9:].tolist())) > 1  # not one token repeated: a real check of the cache


def test_cut_layers_renumbers_the_kv_cache_of_the_model_in_memory():
    """In memory (not reloaded): the kept layers' ``layer_idx`` is renumbered, so ``generate``'s KV cache, indexed by
    it, sees 3 layers; without the renumbering the same cut fails (the cache has no layer 5)."""
    import torch

    ids = torch.tensor([[5, 9, 17, 33, 2]])
    model = _tiny_model("llama", 64, 2)
    assert cut_layers(model, 3) == [0, 3, 5]
    assert [l.self_attn.layer_idx for l in model.model.layers] == [0, 1, 2] and model.config.num_hidden_layers == 3
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             pad_token_id=0, eos_token_id=-1)
    assert gen.tolist() == _greedy_without_cache(model, ids, 10).tolist()
    plain = _tiny_model("llama", 64, 2)  # the same cut without renumbering
    plain.model.layers = torch.nn.ModuleList(plain.model.layers[i] for i in (0, 3, 5))
    plain.config.num_hidden_layers = 3
    with pytest.raises(IndexError), torch.no_grad():
        plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                       pad_token_id=0, eos_token_id=-1)
    with pytest.raises(ValueError, match="no model.layers"):
        cut_layers(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="1 to 3"):
        cut_layers(model, 4)


# ------------------------------------------------------------------------------------------- reverse KL


def _plain_reverse_kl(student, teacher, prompts: list[list[int]], completions: list[list[int]], eos: set[int],
                      temperature: float) -> tuple[float, float, int]:
    """Per sequence, unpadded: the prompt's real tokens, then the completion up to and including its first EOS; each
    completion token's log p_s - log p_t and the exact KL(p_s || p_t) at its position, summed."""
    import torch

    sampled = full = 0.0
    n = 0
    for p, c in zip(prompts, completions):
        end = next((i + 1 for i, t in enumerate(c) if t in eos), len(c))
        seq = torch.tensor([p + c[:end]])
        with torch.no_grad():
            ls = torch.log_softmax(student(input_ids=seq).logits[0] / temperature, -1)
            lt = torch.log_softmax(teacher(input_ids=seq).logits[0] / temperature, -1)
        for j in range(end):
            at, tok = len(p) - 1 + j, c[j]
            sampled += float(ls[at, tok] - lt[at, tok])
            full += float(sum(math.exp(a) * (a - b) for a, b in zip(ls[at].tolist(), lt[at].tolist())))
            n += 1
    return sampled, full, n


def test_reverse_kl_sums_match_a_plain_loop_with_left_padding_and_eos():
    import torch

    student, teacher = _tiny_model("llama", 40, 3), _tiny_model("llama", 40, 4)
    pad, eos = 0, {1, 7}
    prompts = [[11, 12], [13, 14, 15, 16], [17, 18, 19]]
    # row 0: EOS 7 at t=2, then tokens that must not count; row 1: no EOS (clipped); row 2: EOS 1 first
    completions = [[20, 21, 7, 22, 23], [24, 25, 26, 27, 28], [1, 29, 30, 31, 32]]
    P = max(map(len, prompts))
    seqs = torch.tensor([[pad] * (P - len(p)) + p + c for p, c in zip(prompts, completions)])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    for temperature in (1.0, 0.7):
        got = reverse_kl_sums(student, teacher, seqs, mask, eos, temperature)
        want = _plain_reverse_kl(student, teacher, prompts, completions, eos, temperature)
        assert got[2] == want[2] == 3 + 5 + 1
        assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == pytest.approx(want[1], abs=1e-4)
        assert got[1] > 0
    # the tokens after row 0's EOS are left out: counting them changes the sums
    with_tail = _plain_reverse_kl(student, teacher, prompts, [[20, 21, 22, 23, 7]] + completions[1:], eos, 1.0)
    assert with_tail[2] == 11 and with_tail[0] != pytest.approx(got[0], abs=1e-3)
    # a model against itself: no divergence
    assert reverse_kl_sums(student, student, seqs, mask, eos)[:2] == pytest.approx((0.0, 0.0), abs=1e-5)


def test_reverse_kl_probe_samples_and_is_zero_against_itself(tmp_path):
    """The probe end to end on tiny random models with SmolLM2's tokenizer and chat template: the start against
    itself gives 0, against another model a positive exact KL; counts within their bounds."""
    tok = _smol_tokenizer()
    for name, seed in (("s", 5), ("t", 6)):
        _tiny_model("llama", len(tok), seed, layers=2).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    problems = ["What is 2 + 3?", "Tom has 4 apples and eats one. How many are left?", "What is 7 x 8?"]
    kw = dict(prompt_style="reasoning", temperature=1.0, max_new_tokens=6, seed=0, batch=2)
    same = reverse_kl_probe(str(tmp_path / "s"), str(tmp_path / "s"), problems, **kw)
    other = reverse_kl_probe(str(tmp_path / "s"), str(tmp_path / "t"), problems, **kw)
    assert same["kl_sampled"] == pytest.approx(0.0, abs=1e-5) and same["kl_full"] == pytest.approx(0.0, abs=1e-5)
    assert other["kl_full"] > 0.01
    for r in (same, other):
        assert r["problems"] == 3 and 3 <= r["tokens"] <= 18 and 0 <= r["clipped"] <= 3
        assert (r["temperature"], r["max_new_tokens"]) == (1.0, 6)
    assert same["tokens"] == other["tokens"]  # one seed: the start's samples are the same


# ------------------------------------------------------------------------------------------- problems files


def _gsm8k_file(path: Path, n: int, offset: int = 0) -> Path:
    path.write_text("".join(json.dumps({"question": f"Sam has {i} pens and buys {i + 1} more. How many now?",
                                        "answer": f"Sam has {i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}.\n"
                                                  f"#### {2 * i + 1}"}) + "\n"
                            for i in range(offset, offset + n)))
    return path


def test_build_data_from_files_keeps_the_arms_problems_unseen(tmp_path):
    """--train_data with --unseen_arm_problems: the start and the teacher SFT on the file's first teacher_n_train
    problems, the arms train on the next n_train, the held-out set is the file's last n_test; with --test_data, that
    file's first n_test."""
    from bench.learning_data import build_data, read_rows

    f = _gsm8k_file(tmp_path / "probs.jsonl", 40)
    ids = [f"probs-{i}" for i in range(40)]
    cfg = LearningConfig(out=str(tmp_path / "u"), train_data=str(f), n_train=5, teacher_n_train=12, n_test=6,
                         start_sft_steps=1, unseen_arm_problems=True)
    d = build_data(cfg)
    assert set(d) == {"train", "test", "curriculum", "teacher_curriculum", "start_curriculum"}
    got = {k: [r["problem_id"] for r in read_rows(p)] for k, p in d.items()}
    assert got["teacher_curriculum"] == got["start_curriculum"] == ids[:12]
    assert got["train"] == got["curriculum"] == ids[12:17]
    assert got["test"] == ids[34:]
    cur = read_rows(d["curriculum"])
    assert cur[0]["reference"] == "Sam has 12 + 13 = 25.\nThe answer is \\boxed{25}."  # annotation gone, answer boxed
    assert cur[0]["answer"] == "25" and cur[0]["source"] == "probs"
    assert [r["curriculum_index"] for r in cur] == list(range(5))
    assert read_rows(d["test"])[-1]["solution"].endswith("\\boxed{79}.")
    assert build_data(cfg) == d  # built once: a second call reads the files
    # without --unseen_arm_problems the arms train on the start's own problems, as before
    plain = build_data(LearningConfig(out=str(tmp_path / "p"), train_data=str(f), n_train=5, n_test=6))
    assert set(plain) == {"train", "test", "curriculum"}
    assert [r["problem_id"] for r in read_rows(plain["train"])] == ids[:5]
    # --test_data: its first n_test problems
    t = _gsm8k_file(tmp_path / "held.jsonl", 10, offset=100)
    held = build_data(LearningConfig(out=str(tmp_path / "h"), train_data=str(f), test_data=str(t), n_train=5,
                                     teacher_n_train=12, n_test=4, start_sft_steps=1, unseen_arm_problems=True))
    assert [r["problem_id"] for r in read_rows(held["test"])] == [f"held-{i}" for i in range(4)]
    assert [r["problem_id"] for r in read_rows(held["train"])] == ids[12:17]


def test_build_data_refuses_an_overlap_or_too_few_problems(tmp_path):
    from bench.learning_data import build_data

    f = _gsm8k_file(tmp_path / "probs.jsonl", 40)
    # the held-out file repeats training problem 7 (spacing and case changed) as its row 2
    t = tmp_path / "leak.jsonl"
    rows = [json.loads(x) for x in _gsm8k_file(tmp_path / "x.jsonl", 5, offset=200).read_text().splitlines()]
    rows[2]["question"] = "  SAM has 7 pens and   buys 8 more. How many now?"
    t.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"held-out problem 'leak-2' of .*leak.jsonl is also training problem "
                                         r"'probs-7' of .*probs.jsonl"):
        build_data(LearningConfig(out=str(tmp_path / "a"), train_data=str(f), test_data=str(t), n_train=10, n_test=5))
    # the start's and the teacher's 22, the arms' 10 after them and 10 held out: 42 asked of a file of 40
    with pytest.raises(ValueError, match=r"probs.jsonl has 40 usable problems, 42 needed .*unseen_arm_problems"):
        build_data(LearningConfig(out=str(tmp_path / "b"), train_data=str(f), n_train=10, teacher_n_train=22,
                                  n_test=10, start_sft_steps=1, unseen_arm_problems=True))
    assert not (tmp_path / "b" / "data" / "train.parquet").exists()  # refused before anything is written
    with pytest.raises(ValueError, match=r"held.jsonl has 3 usable problems, 4 needed"):
        build_data(LearningConfig(out=str(tmp_path / "c"), train_data=str(f), n_train=5, n_test=4,
                                  test_data=str(_gsm8k_file(tmp_path / "held.jsonl", 3, offset=300))))
    with pytest.raises(FileNotFoundError):
        build_data(LearningConfig(out=str(tmp_path / "d"), train_data=str(tmp_path / "none.jsonl"), n_train=5))


@pytest.mark.parametrize("kw,match", [
    (dict(student_layers=-1), "student_layers"), (dict(student_layers=4, student_layer_choice="last"), "student_layer"),
    (dict(student_layers=4), "start_sft_steps"), (dict(student_layers=4, start_sft_steps=1, start_model="/s"), "start_model"),
    (dict(lr_scheduler_type="cosine"), "lr_scheduler_type"), (dict(lr_warmup_s=5.0), "time schedule only"),
    (dict(lr_scheduler_type="linear_time", lr_warmup_s=-1.0), "lr_warmup_s"),
    (dict(lr_scheduler_type="linear_time", warmup_steps=10), "warmup_steps"),
    (dict(start_lr=-1e-5), "start_lr"), (dict(kl_probe_problems=-1), "kl_probe_problems"),
    (dict(gate_lead=1.5), "gate_lead"), (dict(test_data="/t.jsonl"), "test_data goes with train_data"),
    (dict(unseen_arm_problems=True), "unseen_arm_problems"),
    (dict(unseen_arm_problems=True, start_sft_steps=1, teacher_model="/t"), "unseen_arm_problems"),
    (dict(unseen_arm_problems=True, start_sft_steps=1, teacher_n_train=12000, fresh_arm_problems=True),
     "unseen_arm_problems"),
    (dict(contrasts="j"), "x:y"), (dict(contrasts="j:d-s1"), "without a seed"), (dict(contrasts="j:z"), "not an arm"),
    (dict(arms="d+kl3"), r"\+kl"), (dict(arms="l+kl1"), r"\+kl"), (dict(arms="c+kl0"), r"\+kl"),
    (dict(arms="c+ep2"), r"\+ep"), (dict(arms="j+ep0"), r"\+ep")])
def test_regime3_settings_are_checked(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        LearningConfig(out=str(tmp_path / "r"), **kw)


def test_regime3_preset_is_the_plan(tmp_path):
    """The preset holds run-3-plan.md's regime: 12 of 30 layers, GSM8K train in file order with the arms on problems
    neither the start nor the teacher saw, 320-token cap, 300 problems measured by stage one, 8 passes, avg@4 on
    1,500 held-out problems, the +0.15 gate; and its problems fit GSM8K train's 7,473 rows."""
    cfg = LearningConfig(out=str(tmp_path / "r"), preset="regime3")
    assert (cfg.student_layers, cfg.max_completion_length, cfg.stage_one_problems, cfg.sft_max_epochs) == (12, 320, 300, 8)
    assert (cfg.n_test, cfg.eval_samples, cfg.gate_lead, cfg.unseen_arm_problems) == (1500, 4, 0.15, True)
    assert Path(cfg.train_data).name == "gsm8k_train.jsonl" and cfg.lr_scheduler_type == "linear_time"
    assert cfg.teacher_n_train + cfg.n_train + cfg.n_test <= 7473
    assert set(PRESETS["regime3"]) <= {f for f in LearningConfig.__dataclass_fields__}
    assert LearningConfig(out=str(tmp_path / "r"), preset="regime3", max_completion_length=64).max_completion_length == 64


# ------------------------------------------------------------------------------------------- schedule, run names


def test_window_fraction_counts_from_the_arms_first_step():
    from bench.learning_clock import MarkClock, clock_fraction

    class Now:
        t = 100.0

        def __call__(self):
            return self.t

    now = Now()
    clock = MarkClock([100], lambda *a: None, clock=now, sync=lambda: None)
    win, whole = clock_fraction(clock, 40.0, window=True), clock_fraction(clock, 40.0)
    assert win() == 0.0 and whole() == 0.0  # read before the clock starts (a scheduler reads its factor when built)
    clock.start(offset_s=10.0)  # stage one's 10 s, charged before the first step
    assert win() == 0.0 and whole() == pytest.approx(0.25)
    now.t += 15.0
    assert win() == pytest.approx(15 / 30) and whole() == pytest.approx(25 / 40)
    clock.paused_call(lambda: setattr(now, "t", now.t + 50.0))  # an evaluation: off the clock
    assert win() == pytest.approx(15 / 30)
    now.t += 15.0
    assert win() == 1.0 == whole()
    now.t += 60.0
    assert win() == 1.0  # clamped
    assert clock_fraction(clock, 0.0, window=True) is None


def test_time_schedule_recipes_warm_up_over_the_arms_window(tmp_path):
    """lr_scheduler_type linear_time: each arm's recipe decays to 0 with lr_warmup_s as a share of its training window
    (budget_s less stage one's seconds for an off-policy arm), the start's and the teacher's SFT stays constant, and
    the trainer's schedule over the bench's window fraction gives the plain formula."""
    from bench.learning import _yaml, arm_recipe, train_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig
    from trainers.schedules import decay_factor

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="c,d", budget_s=150, marks="50,150",
                         lr_scheduler_type="linear_time", lr_warmup_s=10.0)
    cfg.dir.mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    (cfg.dir / "data").mkdir()
    (cfg.dir / "data" / "stage_one.json").write_text(json.dumps({"seconds": 50.0}))
    for arm, warm in (("c", 10 / 150), ("d", 10 / 100), ("j", 10 / 100)):
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, arm), tmp_path / f"{arm}.yaml"))],
                               env={})
        assert getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type) == "linear_time", arm
        assert args.lr_warmup_time == pytest.approx(warm) and args.lr_final_ratio == 0.0, arm
    sft = train_recipe(cfg, "sft", student="s", curriculum=tmp_path / "c.parquet", out_dir=tmp_path / "o",
                       learning_rate=1e-4, seed=0)
    assert sft["lr_scheduler_type"] == "constant" and "lr_warmup_time" not in sft
    # the factor over d's window: 0 at its first step, the peak after 10 s, half of it 55 s into the 100 s window
    w = 0.1
    assert [decay_factor("linear", f, warmup=w) for f in (0.0, 0.05, 0.1, 0.55, 1.0)] == pytest.approx(
        [0.0, 0.5, 1.0, 1 - (0.55 - w) / (1 - w), 0.0])


def test_kl_weight_and_passes_in_run_names(tmp_path):
    from bench.learning import _yaml, arm_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="j@3e-6+kl3+ep4,c+kl0.1,l+ep2,d", seeds="0,1",
                         sft_max_epochs=8, learning_rate=1e-6)
    assert cfg.instances == ["j@3e-06+kl3+ep4", "j@3e-06+kl3+ep4-s1", "c+kl0.1", "c+kl0.1-s1", "l+ep2", "l+ep2-s1",
                             "d", "d-s1"]
    assert cfg.parse_run("j@3e-06+kl3+ep4-s1") == ("j", 3e-6, 1)
    assert cfg.run_options("j@3e-06+kl3+ep4-s1") == {"w_kl": 3.0, "sft_max_epochs": 4.0}
    assert cfg.run_options("l+ep2") == {"sft_max_epochs": 2.0} and cfg.run_options("d-s1") == {}
    assert cfg.canonical("j@3e-6+kl3.0+ep4") == "j@3e-06+kl3+ep4" and cfg.canonical("c@1e-6") == "c"
    assert cfg.run_name("j", 3e-6, 2, w_kl=10.0, sft_max_epochs=4.0) == "j@3e-06+kl10+ep4-s2"
    assert cfg.label("j@3e-06+kl3+ep4") == ("sequential: SFT on verified solutions for 4 passes, then OPD + reward, "
                                            "w_kl 3 (KL : reward = 3 : 1), lr 3e-06")
    (cfg.dir).mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    want = {"j@3e-06+kl3+ep4-s1": (3.0, 1.0, 4.0, 3e-6, 1), "c+kl0.1": (0.1, 1.0, 0.0, 1e-6, 0),
            "l+ep2": (0.0, 1.0, 2.0, 1e-6, 0), "j": (1.0, 1.0, 8.0, 1e-6, 0)}
    for name, w in want.items():
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, name), tmp_path / "x.yaml"))], env={})
        assert (args.w_kl, args.w_reward, args.sft_max_epochs, args.learning_rate, args.seed) == w, name
    both = {k for k, v in ARM_SPECS.items() if v.w_kl > 0 and v.w_reward > 0}
    assert both == {"c", "e", "f", "g", "h", "i", "j"}


def test_rollout_batch_and_updates_in_run_names(tmp_path):
    """+bs<n>: the run's rollout batch; +spg<n>: that batch split into n optimizer steps (run 4's arms R and F-m)."""
    from bench.learning import _yaml, arm_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="b+bs8,j+spg16,j@3e-6+kl3+bs32+spg4", seeds="0,1",
                         per_device_train_batch_size=128, num_generations=4, learning_rate=1e-6)
    assert cfg.instances == ["b+bs8", "b+bs8-s1", "j+spg16", "j+spg16-s1", "j@3e-06+kl3+bs32+spg4",
                             "j@3e-06+kl3+bs32+spg4-s1"]
    assert cfg.parse_run("j@3e-06+kl3+bs32+spg4-s1") == ("j", 3e-6, 1)
    assert cfg.run_options("j@3e-06+kl3+bs32+spg4-s1") == {"w_kl": 3.0, "batch": 32, "spg": 4}
    assert cfg.label("j+spg16").endswith(", rollouts of 128 in 16 updates")
    for bad in ("d+bs8", "b+bs6", "b+bs8+spg3", "b+spg0"):
        with pytest.raises(ValueError):
            cfg.run_options(bad)
    (cfg.dir).mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    want = {"b+bs8": (8, 1, 1), "j+spg16-s1": (8, 1, 16), "j@3e-06+kl3+bs32+spg4": (8, 1, 4), "c": (128, 1, 1)}
    for name, w in want.items():
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, name), tmp_path / "x.yaml"))], env={})
        got = (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation)
        assert got == w, name


def test_micro_batch_splits_each_step_without_changing_it(tmp_path):
    """--micro_batch: every optimizer step (an arm's update, the teacher's RL, an SFT step) runs in micro-batches of
    at most that many rows (on-policy: accumulation steps; SFT: the trainer's sft_micro_batch_size slices); the rows a
    step sees, the rollout batch and its updates stay as they were. A step that cannot split evenly is refused when
    the settings are read, naming the run, not mid-run."""
    import bench.learning as bl
    from bench.learning import _yaml, arm_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="c,j+spg4,b+bs8,d,b+bs24", per_device_train_batch_size=128,
                         num_generations=4, micro_batch=32, sft_batch_size=64)
    (cfg.dir).mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    want = {"c": (32, 4, 1), "j+spg4": (32, 1, 4), "b+bs8": (8, 1, 1), "d": (128, 1, 1), "b+bs24": (24, 1, 1)}
    for name, w in want.items():
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, name), tmp_path / "x.yaml"))], env={})
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == w
        assert args.sft_micro_batch_size == 32  # d's SFT steps of 64: two slices of 32
    teacher = bl.train_recipe(cfg, "a", student="s", curriculum=tmp_path / "c.parquet", out_dir=tmp_path / "t",
                              learning_rate=3e-6, seed=0, arm_schedule=False)
    assert (teacher["per_device_train_batch_size"], teacher["gradient_accumulation_steps"]) == (32, 4)
    assert cfg.accumulation_steps(24, with_sft=False) == 1 and LearningConfig(
        out=str(tmp_path / "q"), per_device_train_batch_size=128, micro_batch=16).accumulation_steps(24, with_sft=False) == 2
    for bad, msg in ((dict(arms="b+bs68"), r"\(b\+bs68\): a step of 68 completions must split evenly into 3"),
                     (dict(arms="j", sft_batch_size=6), r"\(j\): a step of 128 completions and SFT steps of 6"),
                     (dict(arms="c", per_device_train_batch_size=96, micro_batch=20), "split evenly into 5"),
                     (dict(micro_batch=-1), "micro_batch must be >= 0")):
        with pytest.raises(ValueError, match=msg):
            LearningConfig(out=str(tmp_path / "p"), **{"per_device_train_batch_size": 128, "num_generations": 4,
                                                        "micro_batch": 32, **bad})


def test_const_runs_one_arm_at_a_constant_rate_under_a_time_schedule(tmp_path):
    """+const (run 4's arm R, the reference recipe's constant rate): that run's recipe is constant while the others
    keep the run's linear_time schedule; refused where the run's schedule is constant already."""
    from bench.learning import _yaml, arm_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="b+bs8+const,j", seeds="0,2", per_device_train_batch_size=128,
                         num_generations=4, learning_rate=1e-6, lr_scheduler_type="linear_time", lr_warmup_s=10.0)
    assert cfg.instances == ["b+bs8+const", "b+bs8+const-s2", "j", "j-s2"]
    assert cfg.parse_run("b+bs8+const-s2") == ("b", 1e-6, 2)
    assert cfg.run_options("b+bs8+const-s2") == {"batch": 8, "const": True}
    assert cfg.label("b+bs8+const").endswith(", rollouts of 8, constant rate")
    (cfg.dir).mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    for name, sched in (("b+bs8+const-s2", "constant"), ("j", "linear_time")):
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, name), tmp_path / "x.yaml"))], env={})
        assert args.lr_scheduler_type == sched, name
    with pytest.raises(ValueError, match="constant already"):
        LearningConfig(out=str(tmp_path / "c"), arms="b+const")


# ------------------------------------------------------------------------------------------- setup lines, contrasts


def _rows(name, rates: dict[str, list[int]], mark=0.0, step=0):
    return [dict(name=name, mark_s=mark, train_s=mark, step=step, problem_id=p, level="1", sample_index=i,
                 completion="", correct=bool(c), correct_numeric=bool(c), correct_math=bool(c), extracted=None,
                 n_tokens=10 + 10 * i, finish_reason="length" if i == 0 else "stop")
            for p, cs in rates.items() for i, c in enumerate(cs)]


def _t_quantile_plain(p: float, df: float) -> float:
    """Student's t quantile by Simpson integration of its density and bisection (no special functions)."""
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def cdf(t: float, n: int = 4000) -> float:
        h = t / n
        s = sum((1 if k in (0, n) else 4 if k % 2 else 2) * c * (1 + (k * h) ** 2 / df) ** (-(df + 1) / 2)
                for k in range(n + 1))
        return 0.5 + s * h / 3

    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def test_t_quantile_and_welch_match_plain_formulas():
    from bench.learning_report import t_interval, t_quantile, welch

    for df, table in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (299, 1.9679)):
        assert t_quantile(0.975, df) == pytest.approx(table, abs=2e-4), df
    for df in (2.3, 4.0, 7.6):  # Welch's df is not whole
        assert t_quantile(0.975, df) == pytest.approx(_t_quantile_plain(0.975, df), abs=1e-4), df
    assert t_interval(0.1, 0.02, 10) == pytest.approx((0.1 - 2.2281 * 0.02, 0.1 + 2.2281 * 0.02), abs=1e-5)
    assert t_interval(0.1, None, 10) is None
    x, y = [0.80, 0.76, 0.78], [0.70, 0.74]
    a, b = (0.02**2 + 0.02**2) / 2 / 3, (0.02**2 + 0.02**2) / 1 / 2
    se, df = welch(x, y)
    assert se == pytest.approx(math.sqrt(a + b)) and df == pytest.approx((a + b) ** 2 / (a * a / 2 + b * b / 1))
    assert welch([0.5], y) is None and welch([0.5, 0.5], [0.5, 0.5]) is None
    with pytest.raises(ValueError):
        t_quantile(0.4, 3)


def test_welch_command_gives_rule_ones_interval_over_seeds(capsys):
    """``python -m bench.learning_report welch``: the mean difference, Welch's error and df and the t-interval
    against plain formulas, the verdict from the interval, and a refusal (exit 2) where no interval exists."""
    from bench.learning_report import main

    x, y = [0.80, 0.76, 0.78], [0.70, 0.74]
    a, b = (0.02**2 + 0.02**2) / 2 / 3, (0.02**2 + 0.02**2) / 1 / 2
    se, df = math.sqrt(a + b), (a + b) ** 2 / (a * a / 2 + b * b / 1)
    h = _t_quantile_plain(0.975, df) * se
    assert main(["welch", "A=0.80,0.76,0.78", "B=0.70,0.74"]) == 0
    out = capsys.readouterr().out
    assert f"A − B over seeds: +0.0600 ± {se:.4f}" in out
    assert f"t-interval {0.06 - h:+.4f} to {0.06 + h:+.4f}, df {df:.1f}" in out
    assert out.strip().endswith("A level")  # df 1.6: the interval is wide enough to hold 0
    assert main(["welch", "N=0.383,0.384,0.382", "F=0.365,0.363,0.362"]) == 0
    assert capsys.readouterr().out.strip().endswith("N ahead")
    assert main(["welch", "N = 0.383, 0.384,0.382", "F=0.365,0.363,0.362"]) == 0  # spaces around names and scores
    assert capsys.readouterr().out.startswith("N − F over seeds: +0.0197")
    for bad, why in ((["A=0.8", "B=0.7,0.74"], "needs >= 2 scores (seeds) on each side: A has 1"),
                     (["A=0.8,0.8", "B=0.7,0.7"], "each all equal: no spread between seeds"),
                     (["0.8,0.7", "B=0.7,0.74"], "expected NAME=score,score"),
                     (["A=0.8,0.7,", "B=0.7,0.74"], "an empty score (a comma too many?)"),
                     (["A=0.8,x", "B=0.7,0.74"], "not a number among the scores"),
                     (["A=0.8,1.5", "B=0.7,nan"], "1.5 not between 0 and 1"),
                     (["A=0.8,0.7", "A=0.7,0.74"], "both sides are named 'A'")):
        with pytest.raises(SystemExit) as e:
            main(["welch", *bad])
        assert e.value.code == 2 and why in capsys.readouterr().err, bad


def test_setup_lines_give_the_gate_and_the_kl(tmp_path):
    """The setup's measurement against plain formulas: teacher − start paired over problems, the teacher on the
    problems where none of the start's samples is right, and the probe's KL."""
    from bench.learning_report import report, setup_lines, setup_measures

    cfg = LearningConfig(out=str(tmp_path / "run"), arms="c,d", marks="10,20", budget_s=20, n_test=4, eval_samples=2)
    ev = cfg.dir / "evals"
    start = {"p1": [0, 0], "p2": [1, 0], "p3": [0, 0], "p4": [1, 1]}
    teacher = {"p1": [1, 1], "p2": [1, 0], "p3": [0, 1], "p4": [1, 1]}
    write_parquet(_rows("student", start), ev / "student.parquet")
    write_parquet(_rows("teacher", teacher, 5, 3), ev / "teacher.parquet")
    m = setup_measures(cfg, "numeric")
    diffs = [1.0, 0.0, 0.5, 0.0]
    mean = sum(diffs) / 4
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3) / 2
    assert (m["start"], m["teacher"]) == (0.375, 0.75)
    assert m["lead"] == pytest.approx(mean) and m["lead_stderr"] == pytest.approx(se) and m["lead_df"] == 3
    assert m["lead_ci95"] == pytest.approx((mean - 3.1824 * se, mean + 3.1824 * se), abs=1e-4)
    assert m["start_fails"]["problems"] == 2 and m["start_fails"]["teacher"] == pytest.approx(0.75)  # p1, p3
    assert m["start_tokens"] == 15.0 and m["start_clip"] == 0.5 and "reverse_kl" not in m
    kl = dict(problems=3, tokens=42, clipped=1, temperature=1.0, max_new_tokens=320, kl_sampled=0.8123,
              kl_full=0.7456)
    (cfg.dir / "data").mkdir(parents=True)
    (cfg.dir / "data" / "setup_kl.json").write_text(json.dumps(kl))
    lines = setup_lines(setup_measures(cfg, "numeric"), cfg)
    assert lines[0].startswith(f"teacher − start on the 4 held-out problems: +0.375 ± {se:.3f} (95% t-interval")
    assert "start 0.375" in lines[0] and "teacher 0.750" in lines[0]
    assert lines[1] == "on the 2 held-out problems the start fails (0 of 2 samples right): teacher 0.750 ± 0.250"
    assert lines[2].startswith("per-token reverse KL of the start's samples under the teacher: 0.812 nats "
                               "(sampled-token estimate), 0.746 exact")
    assert "42 tokens of 3 samples" in lines[2] and "1 clipped" in lines[2]
    write_parquet(_rows("c", {p: [1, 1] for p in start}, 10, 1) + _rows("c", {p: [1, 1] for p in start}, 20, 2),
                  ev / "c.parquet")
    report(cfg)
    md = (cfg.dir / "results.md").read_text()
    assert "### The setup, before any arm" in md and f"- {lines[1]}" in md
    assert md.index("The setup, before any arm") < md.index("### avg@2, answer filter `numeric`")


def test_report_contrasts_pool_seeds_and_give_t_intervals(tmp_path):
    from bench.learning_report import report

    cfg = LearningConfig(out=str(tmp_path / "run"), arms="j,d", seeds="0,1", marks="10,20", budget_s=20, n_test=3,
                         eval_samples=2, late_marks=2, contrasts="j:d,j+kl3:d,d:j")
    ev = cfg.dir / "evals"
    probs = ("p1", "p2", "p3")
    write_parquet(_rows("student", {p: [0, 0] for p in probs}), ev / "student.parquet")
    runs = {"j": ([1, 1], [1, 0], [0, 0]), "j-s1": ([1, 0], [1, 1], [0, 1]),
            "d": ([1, 0], [0, 0], [0, 0]), "d-s1": ([0, 0], [1, 0], [0, 1])}
    for name, (a, b, c) in runs.items():
        rows = {"p1": a, "p2": b, "p3": c}
        write_parquet(_rows(name, rows, 10, 1) + _rows(name, rows, 20, 2), ev / f"{name}.parquet")
    got = {(c["x"], c["y"]): c for c in report(cfg)["contrasts"]}
    # per problem, j's 4 samples over both seeds against d's: (3/4 - 1/4, 3/4 - 1/4, 1/4 - 1/4)
    diffs = [0.5, 0.5, 0.0]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2) / math.sqrt(3)
    jd = got[("j", "d")]
    for key in ("last", "late"):  # both marks hold the same rows here
        assert jd[key]["diff"] == pytest.approx(mean) and jd[key]["stderr"] == pytest.approx(se)
        assert jd[key]["df"] == 2 and jd[key]["ci95"] == pytest.approx((mean - 4.3027 * se, mean + 4.3027 * se),
                                                                         abs=1e-4)
    # between runs: each run's late mean (j 0.5, 0.667; d 0.167, 0.333), Welch
    lx, ly = [3 / 6, 4 / 6], [1 / 6, 2 / 6]
    sx = sy = (1 / 6) ** 2 / 2
    br = jd["between_runs"]
    assert br["runs"] == [2, 2] and br["diff"] == pytest.approx(sum(lx) / 2 - sum(ly) / 2)
    assert br["stderr"] == pytest.approx(math.sqrt(sx / 2 + sy / 2)) and br["df"] == pytest.approx(2.0)
    assert got[("d", "j")]["last"]["diff"] == pytest.approx(-mean)
    assert got[("j+kl3", "d")]["missing"] == ["j+kl3"]
    md = (cfg.dir / "results.md").read_text()
    assert f"- j − d: at 20 s +{mean:.3f} ± {se:.3f} (95% t-interval" in md and "- j+kl3 − d: no runs of j+kl3" in md


# ------------------------------------------------------------------------------------------- the setup, end to end


@pytest.mark.slow  # ~30 s on 2 cores: three model builds, three evaluations, a probe
def test_setup_stage_cuts_heals_builds_the_teacher_and_gates(tmp_path):
    """``--stage setup`` of regime (iii) through the bench's CLI on a tiny random 6-layer model with SmolLM2's
    tokenizer: cut to 2 layers -> healed start (2 layers) -> teacher from the whole model (6 layers) -> the setup's
    lines and the KL probe; then a command with arms stops at the gate (exit 3) before any arm."""
    import subprocess
    import sys

    from transformers import AutoConfig

    root = Path(__file__).resolve().parents[1]
    tok = _smol_tokenizer()
    model = tmp_path / "tiny"
    _tiny_model("llama", len(tok), 7).save_pretrained(model)
    tok.save_pretrained(model)
    probs = _gsm8k_file(tmp_path / "probs.jsonl", 30)
    out = tmp_path / "run"
    args = ["--out", str(out), "--preset", "cpu_smoke", "--student_model", str(model), "--train_data", str(probs),
            "--student_layers", "2", "--start_sft_steps", "1", "--teacher_sft_steps", "1", "--n_train", "4",
            "--teacher_n_train", "8", "--unseen_arm_problems", "--n_test", "3", "--max_completion_length", "8",
            "--kl_probe_problems", "2", "--lr_scheduler_type", "linear_time", "--lr_warmup_s", "1",
            "--fast_generation", "false"]
    p = subprocess.run([sys.executable, "-m", "bench.learning", *args, "--stage", "setup"], cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "cut student: layers [0, 5] of" in p.stdout
    assert "unseen arm problems: the start and the teacher train on problems 1-8, the arms on 9-12" in p.stdout
    assert "[learning] setup: teacher − start on the 3 held-out problems:" in p.stdout
    assert "[learning] setup: on the " in p.stdout and "[learning] setup: per-token reverse KL" in p.stdout
    layers = {d: AutoConfig.from_pretrained(out / d).num_hidden_layers for d in ("cut_student", "start", "teacher")}
    assert layers == {"cut_student": 2, "start": 2, "teacher": 6}
    kl = json.loads((out / "data" / "setup_kl.json").read_text())
    assert kl["problems"] == 2 and kl["max_new_tokens"] == 8 and kl["kl_full"] > 0
    settings = json.loads((out / "settings.json").read_text())
    assert settings["student_layers"] == 2 and settings["runs"] == []
    # the plan's rule 4: a lead under gate_lead runs no arm (a tiny random teacher leads by nothing)
    p = subprocess.run([sys.executable, "-m", "bench.learning", *args, "--arms", "c", "--gate_lead", "0.9"], cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "gate FAILED" in p.stdout and "no arm run" in p.stdout and not (out / "arms").exists()
