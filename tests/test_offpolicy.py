"""OPDTrainer's off-policy term (trainers.offpolicy): the combined loss against a plain reference, the time share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from tests.test_trainer import curriculum_rows, live_probe, make_trainer, tiny_model, tokenizer  # noqa: F401 - fixture
from trainers.offpolicy import TimeShare, sft_share


def solved_curriculum(tmp_path, solved=lambda i: i % 2 == 0):
    from data_tools.runio import write_parquet

    rows = curriculum_rows()
    for i, r in enumerate(rows):
        r["teacher_solution"] = f"{i} + {i + 1} = {2 * i + 1}. The answer is \\boxed{{{2 * i + 1}}}." if solved(i) else None
    return str(write_parquet(rows, tmp_path / "curate" / "curriculum.parquet"))


def _logp(model, prompt_ids, prompt_mask, comp_ids, comp_mask, temperature=1.0):
    ids, mask = torch.cat([prompt_ids, comp_ids], 1), torch.cat([prompt_mask, comp_mask], 1)
    K = comp_ids.size(1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, comp_ids.unsqueeze(-1)).squeeze(-1)


def _plain_sft_tensors(tok, prompts, sols):
    """Prompt left-padded, solution + EOS right-padded, written out by hand (no trainer code)."""
    pid = tok.pad_token_id
    P = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]  # chat-rendered: the template wrote any BOS
    C = [tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for s in sols]
    lp, lc = max(map(len, P)), max(map(len, C))
    return (torch.tensor([[pid] * (lp - len(p)) + p for p in P]), torch.tensor([[0] * (lp - len(p)) + [1] * len(p) for p in P]),
            torch.tensor([c + [pid] * (lc - len(c)) for c in C]), torch.tensor([[1] * len(c) + [0] * (lc - len(c)) for c in C]))


def test_sft_share_and_time_share():
    assert sft_share(0.0, 0.9, 0.1) == pytest.approx(0.9) and sft_share(0.5, 0.9, 0.1) == pytest.approx(0.5)
    assert sft_share(2.0, 0.9, 0.1) == pytest.approx(0.1)  # clamped
    for share in (0.0, 0.3, 0.7, 1.0):
        ts, off_s, on_s = TimeShare(), 0.0, 0.0
        for _ in range(400):  # off-policy steps take 0.25 s, on-policy ones 2.5 s (run-1 timings)
            off = ts.choose(share)
            dt = 0.25 if off else 2.5
            ts.record(share, off, dt)
            off_s, on_s = off_s + off * dt, on_s + (not off) * dt
        assert off_s / (off_s + on_s) == pytest.approx(share, abs=2.5 / (off_s + on_s) + 1e-9), share


def test_schedule_without_a_trainer(tmp_path):
    """OffPolicySchedule takes what it reads as parameters: step kinds, the solution stream split over processes,
    the hand-over (once), the rate scale of each step, its metrics and its resume state, all without a trainer."""
    from tests.test_trainer import make_args
    from trainers.offpolicy import OffPolicySchedule

    args = make_args(tmp_path, sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4, sft_max_epochs=2.0,
                     sft_handover_reset=2, learning_rate=1e-3, sft_learning_rate=1e-2, gradient_accumulation_steps=1)
    sols = ["s0", None, "s2", "s3", "", "s5"]
    op = OffPolicySchedule(args, sols, world_size=2)
    assert op.pool == [0, 2, 3, 5] and not op.phase_done()
    votes = []
    assert op.choose(0.0, 0, agree=lambda off: votes.append(off) or True) and votes == [True] and op.off_policy
    assert op.rate_scale(0) == pytest.approx(10.0)
    mine = op.next_rows(0, 2)
    op.pos -= 4  # process 1 reads the same batch (each process advances the stream by the whole batch)
    theirs = op.next_rows(1, 2)
    assert sorted(mine + theirs) == [0, 2, 3, 5] and len(mine) == len(theirs) == 2  # one epoch, split over 2 processes
    assert op.finish_step(2.0, 5.0, 40.0) == {"loss/sft": 5.0, "sft/tokens": 40.0, "sft/share": 1.0,
                                              "sft/off_policy_step": 1.0, "sft/epoch": 1.0, "sft/weight": 1.0,
                                              "sft/lr_scale": 1.0}
    assert op.choose(0.5, 1) and not op.handover_now
    assert sorted(op.next_rows(0, 1)) == [0, 2, 3, 5] and op.phase_done()  # 2 passes: nothing left under the cap
    assert not op.choose(0.6, 2) and op.handover_now and op.handover_step == 2 and op.share == 0.0
    assert [op.rate_scale(s) for s in (2, 3, 4)] == [0.5, 1.0, 1.0]  # re-warmed over 2 steps after the hand-over
    assert not op.choose(0.7, 3) and not op.handover_now and op.handover_step == 2
    state = op.state_dict()
    assert {k: state[k] for k in ("sft_pos", "handover_step")} == {"sft_pos": 8, "handover_step": 2}
    fresh = OffPolicySchedule(args, sols, world_size=2)
    fresh.load_state_dict(state)
    assert (fresh.pos, fresh.handover_step, fresh.time_share.credit) == (8, 2, op.time_share.credit)
    with pytest.raises(ValueError, match=r"world size x gradient_accumulation_steps \(4 x 1 = 4\)"):
        OffPolicySchedule(make_args(tmp_path, sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=6,
                                    gradient_accumulation_steps=1), sols, world_size=4)
    assert OffPolicySchedule(make_args(tmp_path), None, world_size=1).finish_step(1.0, 0.0, 0.0) == {}  # terms off


def test_dataset_carries_teacher_solution(tmp_path, tokenizer):  # noqa: F811
    from trainers.data import build_train_dataset, load_curriculum

    ds = build_train_dataset(load_curriculum(solved_curriculum(tmp_path)), tokenizer)
    assert ds["teacher_solution"][0].endswith("\\boxed{1}.") and ds["teacher_solution"][1] == ""


def test_combined_loss_matches_plain_reference(tmp_path, tokenizer):  # noqa: F811
    """OPD (sampled k1) + reward + w_sft * CE on teacher solutions: loss and gradient against a plain forward."""
    w_sft = 0.7
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), teacher=tiny_model(tokenizer, seed=5),
                      teacher_context="teacher", w_sft=w_sft)
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]  # row 0 has a solution, row 1 none
    inputs = tr._generate_and_score_completions(rows)
    inputs["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 2.0, -2.0, 0.3])
    model = tr.accelerator.unwrap_model(tr.model)
    params = [p for p in model.parameters() if p.requires_grad]
    N = inputs["num_items_in_batch"]
    loss, _, _ = tr._compute_loss(model, inputs, N)
    got = torch.autograd.grad(loss, params)

    cm = inputs["completion_mask"].float()
    lp = _logp(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
               tr.temperature)
    with torch.no_grad():
        lt = _logp(tr.teacher_model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                   inputs["completion_mask"], tr.temperature)
    a = (-(lp.detach() - lt) + inputs["advantages"].unsqueeze(1)) * cm
    ref_opd = -(a * torch.exp(lp - lp.detach())).sum() / cm.sum()  # the policy-gradient surrogate (rho = 1)
    # the SFT term: one teacher solution (row 0's, once for its group of 4), mean CE per token
    pi, pm, ci, cmask = _plain_sft_tensors(tokenizer, [rows[0]["prompt"]], [rows[0]["teacher_solution"]])
    lps = _logp(model, pi, pm, ci, cmask)
    ref_sft = -(lps * cmask).sum() / cmask.sum()
    ref = ref_opd + w_sft * ref_sft
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad(ref, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert int(inputs["sft_num_items"]) == int(cmask.sum())
    assert float(ref_sft) > 1.0  # a random tiny model: the term is not negligible


def test_off_policy_steps_train_on_solutions_only(tmp_path, tokenizer):  # noqa: F811
    """sft_share = 1: every step is cross-entropy on teacher solutions (no generation, no teacher)."""
    teacher = tiny_model(tokenizer, seed=3)
    calls = []
    teacher.register_forward_hook(lambda *a: calls.append(1))
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), teacher=teacher, teacher_context="teacher",
                      sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4)
    model = tr.accelerator.unwrap_model(tr.model)
    batch = tr._offpolicy_batch()
    assert sorted(set(batch["sft_completion_mask"].sum(1).tolist())) != [0]
    loss, _, n = tr._compute_loss(model, dict(batch), None)
    pool = [tr.train_dataset[i] for i in range(len(tr.train_dataset)) if tr.train_dataset[i]["teacher_solution"]]
    by_prompt = {r["prompt"]: r["teacher_solution"] for r in pool}
    prompts = tokenizer.batch_decode(batch["sft_prompt_ids"], skip_special_tokens=False)
    chosen = [next(p for p in by_prompt if p in text) for text in prompts]
    pi, pm, ci, cm = _plain_sft_tensors(tokenizer, chosen, [by_prompt[p] for p in chosen])
    ref = -(_logp(model, pi, pm, ci, cm) * cm).sum() / cm.sum()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert int(n) == int(cm.sum())

    tr.train()
    assert tr.state.global_step == 2 and calls == [] and not tr.sft_phase_done()  # no cap: never past a hand-over
    recs = [json.loads(x) for x in (Path(tr.args.output_dir) / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["sft/off_policy_step"] for r in recs] == [1.0, 1.0] and recs[-1]["loss/sft"] > 0
    # nothing was sampled: the on-policy terms are absent (null), not a KL of 0
    assert all(r["kl/sampled_mean"] is None and r["loss/kl"] is None and r["ppo/clip_frac"] is None for r in recs)
    assert not list((Path(tr.args.output_dir) / "rollouts").glob("*.parquet"))


def test_no_verified_solution_is_an_error(tmp_path, tokenizer):  # noqa: F811
    unsolved = solved_curriculum(tmp_path, solved=lambda i: False)
    with pytest.raises(ValueError, match="'teacher_solution' column is empty in all 8 rows") as e:
        make_trainer(tmp_path / "a", tokenizer, unsolved, w_sft=1.0)
    assert "counts.teacher_solutions" in str(e.value) and "curriculum.parquet" in str(e.value)  # where to look
    with pytest.raises(ValueError, match="'teacher_solution' column is empty in all 8 rows"):  # a share for the whole clock
        make_trainer(tmp_path / "b", tokenizer, unsolved, sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4)


def test_no_verified_solution_before_a_hand_over_means_on_policy_from_the_first_step(tmp_path, tokenizer, capsys):  # noqa: F811
    """The formal recipe's order (SFT for sft_max_epochs passes, then on-policy) over a curriculum with no verified
    solution (a short first demo's stage one can leave one): zero passes, so every step is on-policy."""
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path, solved=lambda i: False), sft_share_start=1.0,
                      sft_share_end=1.0, sft_max_epochs=2, sft_batch_size=4)
    # said on the console, not only in the log: the recipe's first phase does not run
    assert "over 0 verified teacher solutions (of 8 rows in" in capsys.readouterr().out
    assert tr.sft_phase_done()
    tr.train()
    recs = [json.loads(x) for x in (Path(tr.args.output_dir) / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(recs) == tr.state.global_step >= 1 and all(not r.get("sft/off_policy_step") for r in recs)
    assert all(isinstance(r["kl/sampled_mean"], float) for r in recs)  # on-policy steps: a KL is measured
    assert list((Path(tr.args.output_dir) / "rollouts").glob("*.parquet"))


def test_resume_under_other_objective_settings_says_which(tmp_path, tokenizer, caplog):  # noqa: F811
    """A run begun on-policy and resumed under a config with SFT first: the saved objective is compared with the
    new one, and each changed setting is named (the run goes on under the new settings)."""
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), sft_share_start=1.0, sft_share_end=1.0,
                      sft_max_epochs=1, sft_batch_size=4)
    same = tr.offpolicy.state_dict()
    assert same["objective"]["sft_max_epochs"] == 1.0 and same["objective"]["w_kl"] == tr.args.w_kl
    with caplog.at_level("WARNING", logger="trainers.offpolicy"):
        tr.offpolicy.load_state_dict(same)
        assert not caplog.records
        before = {**same["objective"], "sft_share_start": 0.0, "sft_share_end": 0.0, "sft_max_epochs": 0.0}
        tr.offpolicy.load_state_dict({**same, "sft_pos": 4, "objective": before})
    [rec] = caplog.records
    assert ("sft_share_start 0.0 -> 1.0, sft_share_end 0.0 -> 1.0, sft_max_epochs 0.0 -> 1.0" in rec.getMessage()
            and tr.offpolicy.pos == 4)
    # past the hand-over (one pass over the 4 solutions done): the saved hand-over step stands
    tr.offpolicy.load_state_dict({**same, "sft_pos": 4, "handover_step": 1})
    assert tr.sft_phase_done() and tr.offpolicy.handover_step == 1
    # settings that reopen the SFT phase (the stream short of the new cap): the hand-over is to come again
    tr.offpolicy.load_state_dict({**same, "sft_pos": 0, "handover_step": 1})
    assert not tr.sft_phase_done() and tr.offpolicy.handover_step is None
    # a checkpoint saved before the settings were recorded: said too, since this run trains on the solutions
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainers.offpolicy"):
        tr.offpolicy.load_state_dict({"sft_pos": 0, "sft_credit": 0.0, "handover_step": None})
    [rec] = caplog.records
    assert "does not record its objective settings" in rec.getMessage() and "sft_max_epochs 1" in rec.getMessage()


def test_sft_batch_size_error_names_a_valid_size(tmp_path, tokenizer):  # noqa: F811
    with pytest.raises(ValueError, match=r"\(4\): e\.g\. 8"):
        make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), sft_share_start=1.0, sft_share_end=1.0,
                     sft_batch_size=10, gradient_accumulation_steps=4)


def test_sft_max_epochs_hands_later_steps_to_on_policy(tmp_path, tokenizer):  # noqa: F811
    """sft_share = 1 with a cap of 2.5 passes over a pool of 4 solutions, 4 a step: two off-policy steps (a third
    would pass the cap), then on-policy for good."""
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), sft_share_start=1.0, sft_share_end=1.0,
                      sft_batch_size=4, sft_max_epochs=2.5, debug_max_steps=4)
    assert len(tr.offpolicy.pool) == 4
    done_at_end = []  # sft_phase_done() after each step: True from the step after which the next is on-policy

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            done_at_end.append(tr.sft_phase_done())

    tr.add_callback(Probe())
    assert not tr.sft_phase_done()
    tr.train()
    recs = [json.loads(x) for x in (Path(tr.args.output_dir) / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["sft/off_policy_step"] for r in recs] == [1.0, 1.0, 0.0, 0.0]
    assert done_at_end == [False, True, True, True]
    assert [r["sft/epoch"] for r in recs] == [1.0, 2.0, 2.0, 2.0] and recs[-1]["sft/share"] == 0.0
    assert len(list((Path(tr.args.output_dir) / "rollouts").glob("*.parquet"))) == 2  # the on-policy steps
    with pytest.raises(ValueError, match="sft_max_epochs > 0 hands the steps after the cap"):
        make_trainer(tmp_path / "b", tokenizer, solved_curriculum(tmp_path / "b"), w_kl=0.0, w_reward=0.0,
                     sft_share_start=1.0, sft_share_end=1.0, sft_max_epochs=1.0)
    with pytest.raises(ValueError, match="sft_max_epochs 1 caps the off-policy steps: to turn SFT off set --sft_max_epochs 0 as well"):
        make_trainer(tmp_path / "c", tokenizer, solved_curriculum(tmp_path / "c"), w_sft=1.0, sft_max_epochs=1.0)


def test_sft_handover_reset_clears_moments_and_rewarms_the_rate(tmp_path, tokenizer):  # noqa: F811
    """sft_handover_reset = 2 after two off-policy steps: the first on-policy step finds the optimizer's state empty
    (Adam's moments and step count gone) and runs at 1/2 of the scheduled rate, the next at 2/2; the SFT steps keep
    their moments and their rate (x10 by sft_learning_rate). The default carries the moments and the rate."""
    kw = dict(sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4, sft_max_epochs=2.5, debug_max_steps=4,
              learning_rate=1e-3, sft_learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0)

    def run(name, **extra):
        tr = make_trainer(tmp_path / name, tokenizer, solved_curriculum(tmp_path / name), **kw, **extra)
        seen = []
        orig = tr.create_optimizer

        def create_optimizer(model=None):  # a probe after the trainer's own hooks: what each step really used
            opt = orig(model)
            inner = getattr(opt, "optimizer", opt)
            inner.register_step_pre_hook(lambda o, *_: seen.append(
                (o.param_groups[0]["lr"], sum(int(st.get("step", 0)) for st in o.state.values()) / max(1, len(o.state)))))
            return opt
        tr.create_optimizer = create_optimizer
        tr.train()
        recs = [json.loads(x) for x in (Path(tr.args.output_dir) / "metrics" / "train.jsonl").read_text().splitlines()]
        return tr, seen, recs

    tr, seen, recs = run("reset", sft_handover_reset=2)
    assert [r["sft/off_policy_step"] for r in recs] == [1.0, 1.0, 0.0, 0.0] and tr.offpolicy.handover_step == 2
    assert [lr for lr, _ in seen] == pytest.approx([1e-2, 1e-2, 0.5e-3, 1e-3])
    assert [n for _, n in seen] == [0, 1, 0, 1]  # Adam's mean step count before each step: reset at the hand-over
    assert [r["sft/lr_scale"] for r in recs] == pytest.approx([10.0, 10.0, 0.5, 1.0])
    assert tr.offpolicy.state_dict()["handover_step"] == 2
    # optim/update_rms: Adam's first step moves each element by at most lr (|m_hat| = sqrt(v_hat) there), and the
    # reset makes the first on-policy step a first step again
    rms = [r["optim/update_rms"] for r in recs]
    assert 0.1 < rms[0] <= 1.0 + 1e-6 and 0.1 < rms[2] <= 1.0 + 1e-6, rms
    _, seen, recs = run("carry")
    assert [lr for lr, _ in seen] == pytest.approx([1e-2, 1e-2, 1e-3, 1e-3]) and [n for _, n in seen] == [0, 1, 2, 3]
    assert all(r["optim/update_rms"] > 0 for r in recs)
    with pytest.raises(ValueError, match=r"sft_handover_reset \(2\) acts at the hand-over"):
        make_trainer(tmp_path / "bad", tokenizer, solved_curriculum(tmp_path / "bad"), w_sft=1.0, sft_handover_reset=2)


def test_resume_from_checkpoint_keeps_the_cap(tmp_path, tokenizer):  # noqa: F811
    """Through a real save and resume: the checkpoint's opd_clock.json holds the stream's position, so a resumed run
    with its cap reached trains on-policy; a checkpoint without it (written before it existed) starts the stream
    again."""
    from trainers.callbacks import find_resume_checkpoint
    from trainers.opd_trainer import CLOCK_STATE

    cur = solved_curriculum(tmp_path)
    kw = dict(sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4, sft_max_epochs=2.0)
    tr = make_trainer(tmp_path, tokenizer, cur, debug_max_steps=2, **kw)
    tr.train()
    ckpt = find_resume_checkpoint(tr.args.resume_dir)
    assert ckpt.endswith("checkpoint-2")
    state = json.loads((Path(ckpt) / CLOCK_STATE).read_text())
    assert state["sft_pos"] == 8
    metrics = Path(tr.args.output_dir) / "metrics" / "train.jsonl"
    saved = tmp_path / "saved-checkpoint-2"  # the resumed run rotates its resume dir: keep a copy to resume twice
    shutil.copytree(ckpt, saved)

    def resume(steps):
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(saved, ckpt)
        tr2 = make_trainer(tmp_path, tokenizer, cur, debug_max_steps=steps, **kw)
        tr2.train(resume_from_checkpoint=ckpt)
        return [json.loads(x) for x in metrics.read_text().splitlines()][-(steps - 2):]

    assert [r["sft/off_policy_step"] for r in resume(3)] == [0.0]  # cap reached before the interruption
    (saved / CLOCK_STATE).write_text(json.dumps({"time_fraction": state["time_fraction"]}))
    old = resume(3)
    assert [r["sft/off_policy_step"] for r in old] == [1.0] and old[0]["sft/epoch"] == 1.0


def test_resumed_run_continues_the_solution_stream(tmp_path, tokenizer):  # noqa: F811
    """The off-policy position and time-share credit saved with a checkpoint: a resumed trainer's next SFT batch is
    the one the uninterrupted run would have taken, and its epoch count (sft_max_epochs) carries on."""
    kw = dict(sft_share_start=0.5, sft_share_end=0.5, sft_batch_size=2, gradient_accumulation_steps=1)
    a = make_trainer(tmp_path / "a", tokenizer, solved_curriculum(tmp_path / "a"), **kw)
    for _ in range(3):  # 3 batches of 2 from a pool of 4: into the second (reshuffled) epoch
        a._offpolicy_batch()
    a.offpolicy.time_share.record(0.5, True, 4.0)
    state = json.loads(json.dumps(a.offpolicy.state_dict()))  # as written to opd_clock.json
    assert {k: v for k, v in state.items() if k != "objective"} == {"sft_pos": 6, "sft_credit": -2.0, "handover_step": None}
    assert (state["objective"]["sft_share_start"], state["objective"]["sft_batch_size"]) == (0.5, 2.0)
    b = make_trainer(tmp_path / "b", tokenizer, solved_curriculum(tmp_path / "b"), **kw)
    b.offpolicy.load_state_dict(state)
    nxt_a, nxt_b = a._offpolicy_batch(), b._offpolicy_batch()
    assert torch.equal(nxt_a["sft_completion_ids"], nxt_b["sft_completion_ids"])
    assert b.offpolicy.time_share.credit == -2.0 and not b.offpolicy.time_share.choose(0.5)  # owes off-policy seconds back
    fresh = make_trainer(tmp_path / "c", tokenizer, solved_curriculum(tmp_path / "c"), **kw)
    assert not torch.equal(fresh._offpolicy_batch()["sft_completion_ids"], nxt_a["sft_completion_ids"])


def test_sft_learning_rate_scales_off_policy_steps_only(tmp_path, tokenizer):  # noqa: F811
    """One off-policy step at learning_rate 1e-3 with sft_learning_rate 1e-2 moves the weights exactly as a run at
    learning_rate 1e-2 does, not as one at 1e-3, and its sft/lr_scale metric is the scale the hook applied; the
    optimizer holds the scheduled rate again after a step, and an on-policy step is not scaled."""
    import torch

    kw = dict(sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4, debug_max_steps=1,
              lr_scheduler_type="constant", warmup_steps=0)

    def weights_after(name, **extra):
        torch.manual_seed(0)
        tr = make_trainer(tmp_path / name, tokenizer, solved_curriculum(tmp_path / name), **kw, **extra)
        tr.train()
        return tr, torch.cat([p.detach().flatten() for p in tr.model.parameters()])

    tr_a, a = weights_after("a", learning_rate=1e-3, sft_learning_rate=1e-2)
    _, b = weights_after("b", learning_rate=1e-2)
    _, c = weights_after("c", learning_rate=1e-3)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert (a - c).abs().max() > 1e-4
    (rec,) = [json.loads(x) for x in (Path(tr_a.args.output_dir) / "metrics" / "train.jsonl").read_text().splitlines()]
    assert rec["sft/off_policy_step"] == 1.0 and rec["sft/lr_scale"] == pytest.approx(10.0)
    # the hooks scale only a step whose batch is off-policy
    opt = getattr(tr_a.optimizer, "optimizer", tr_a.optimizer)  # the torch optimizer inside accelerate's wrapper
    tr_a.offpolicy.off_policy = False
    grads = [torch.zeros_like(p) for p in tr_a.model.parameters()]
    for p, g in zip(tr_a.model.parameters(), grads):
        p.grad = g
    seen = []
    h = opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    opt.step()
    tr_a.offpolicy.off_policy = True
    opt.step()
    h.remove()
    assert seen == [pytest.approx(1e-3), pytest.approx(1e-2)] and opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="sft_learning_rate 1e-05 sets the rate of off-policy steps: to turn SFT off set --sft_learning_rate 0 as well"):
        make_trainer(tmp_path / "d", tokenizer, solved_curriculum(tmp_path / "d"), sft_learning_rate=1e-5)


@pytest.mark.parametrize("ga", [1, 2])
def test_sft_micro_batch_size_slices_an_off_policy_step_without_changing_it(tmp_path, tokenizer, ga):  # noqa: F811
    """sft_micro_batch_size: an off-policy step's micro-batches run in slices (here of 1 and of 3 solutions, the
    last slice shorter), and the step is the one without slices: the same gradient going into the optimizer (no
    clipping), the same SFT loss in its metrics; the backbone's forwards say the slices happened."""
    kw = dict(sft_share_start=1.0, sft_share_end=1.0, sft_batch_size=4, debug_max_steps=1, max_grad_norm=1e9,
              lr_scheduler_type="constant", warmup_steps=0, gradient_accumulation_steps=ga)

    class Grads(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.seen.append(torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()
                                        if p.grad is not None]))

    def run(name, **extra):
        torch.manual_seed(0)
        tr = make_trainer(tmp_path / name, tokenizer, solved_curriculum(tmp_path / name), **kw, **extra)
        rows, grads = [], Grads()
        tr.add_callback(grads)
        model = tr.accelerator.unwrap_model(tr.model)

        def count(m, args, kwargs, out):  # the rows of the backbone's input, however it is called
            x = next(v for v in (*args, *kwargs.values()) if torch.is_tensor(v))
            rows.append(x.size(0))

        h = model.model.register_forward_hook(count, with_kwargs=True)
        tr.train()
        h.remove()
        (rec,) = [json.loads(x) for x in (Path(tr.args.output_dir) / "metrics" / "train.jsonl").read_text().splitlines()]
        (g,) = grads.seen
        return g, rec, rows

    whole, rec, rows = run("whole")
    assert rows == [4 // ga] * ga and whole.abs().sum() > 0  # one forward a micro-batch
    for k, want in ((1, [1] * 4), (3, [3, 1] if ga == 1 else [2, 2])):
        g, r, seen = run(f"k{k}", sft_micro_batch_size=k)
        assert seen == want, k
        torch.testing.assert_close(g, whole, rtol=1e-4, atol=1e-7)
        assert r["loss/sft"] == pytest.approx(rec["loss/sft"], rel=1e-5) and r["sft/off_policy_step"] == 1.0
    with pytest.raises(ValueError, match="sft_micro_batch_size must be >= 0"):
        make_trainer(tmp_path / "bad", tokenizer, solved_curriculum(tmp_path / "bad"), sft_micro_batch_size=-1)


def test_a_step_begun_in_eval_mode_is_still_the_schedules(tmp_path, tokenizer):  # noqa: F811
    """A model in eval mode when a step begins (as from_pretrained leaves it, or after a mark's evaluation) does not
    turn an off-policy step into the parent trainer's evaluation path: the step is the schedule's, in training mode."""
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), sft_share_start=1.0, sft_share_end=1.0,
                      sft_batch_size=4, debug_max_steps=1)
    tr.train()  # the optimizer and the accelerator's wrappers exist
    batch = next(iter(tr.get_train_dataloader()))
    tr._buffered_inputs = None  # a new window
    tr.model.eval()
    loss = tr.training_step(tr.model, batch)
    assert tr.model.training and torch.isfinite(loss)
    # the schedule drew this window (an off-policy batch of teacher solutions), not the parent's generation path
    assert tr._buffered_inputs is not None and "off_policy" in tr._buffered_inputs[0]


def test_nothing_is_kept_across_the_formal_schedule(tmp_path, tokenizer):  # noqa: F811
    """The formal recipe's shape: SFT steps on the solutions until their passes are spent, then on-policy steps
    (KL + reward + w_sft): the tensors alive after each step stay level within each phase and across the hand-over
    (nothing an SFT step or the hand-over makes is kept by the on-policy steps)."""
    tr = make_trainer(tmp_path, tokenizer, solved_curriculum(tmp_path), debug_max_steps=8, sft_share_start=1.0,
                      sft_share_end=1.0, sft_batch_size=4, sft_max_epochs=2.0, w_sft=0.5)
    probe = live_probe()
    tr.add_callback(probe)
    tr.train()
    off = [h.get("sft/off_policy_step") for h in tr.state.log_history if "loss" in h]
    assert off[:2] == [1.0, 1.0] and off[-1] == 0.0, off  # 4 solutions x 2 passes / 4 a step: 2 SFT steps
    assert {k: probe.kept(k) for k in range(2, 7)} == {k: 0 for k in range(2, 7)}
