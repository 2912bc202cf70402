"""Stage two through the real launcher on CPU processes (gloo): ``stages.launch`` (accelerate launch, torchrun
underneath), as ``run.sh`` starts it on a node of N GPUs.

- the first steps' losses (an SFT step, then an on-policy step with greedy sampling) equal the one-process run's;
- one set of exports, each loading; one metrics line a step;
- a SIGTERM to ``run.sh`` mid-training: one finished step, one saved export, exit 143, the lock released, no process
  left (and the run resumed a state saved by one process on two);
- two "nodes" on localhost (torchrun's static rendezvous) train and export;
- a process that dies stops the run with one line naming it, no hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faultkit import processes_mentioning, wait_gone
from tests.test_trainer import curriculum_rows, tiny_model, tokenizer  # noqa: F401 - pytest fixture

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--teacher_context", "teacher", "--prompt_style", "short", "--num_generations", "4",
         "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--max_completion_length", "6",
         "--learning_rate", "1e-3", "--sft_learning_rate", "1e-3", "--sft_share_start", "1", "--sft_share_end", "1",
         "--sft_max_epochs", "1", "--sft_batch_size", "16", "--top_k", "1", "--ckpt_every_minutes", "0",
         "--max_wall_time_seconds", "3000", "--deadline_reserve_seconds", "60", "--use_vllm", "false"]


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):  # noqa: F811
    from data_tools.runio import write_parquet

    d = tmp_path_factory.mktemp("mp")
    for name, vocab, seed in (("student", None, 0), ("teacher", len(tokenizer) + 64, 1)):
        m = tiny_model(tokenizer, vocab_size=vocab, seed=seed)
        m.save_pretrained(d / name)
        tokenizer.save_pretrained(d / name)
    rows = curriculum_rows(16)
    for r in rows:
        r["teacher_solution"] = f"{r['problem']} The answer is {r['answer']}."
    write_parquet(rows, d / "curriculum.parquet")
    return d


def _env(models, out: Path, **extra) -> dict:
    (out / "curate").mkdir(parents=True, exist_ok=True)
    (out / "curate" / "curriculum.parquet").write_bytes((models / "curriculum.parquet").read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("CKPT_DIR", "WORLD_SIZE", "RANK", "NODE_RANK", "NNODES",
                                                             "OPD_RUN_START", "OPD_LOCK_OWNER", "OPD_NUM_PROCESSES")}
    tmp = out.parent / "tmp"  # the launcher's torchelastic_* folders go with the test's own, not /tmp
    tmp.mkdir(exist_ok=True)
    env.update(OUTPUT_DIR=str(out), STUDENT_MODEL=str(models / "student"), TEACHER_MODEL=str(models / "teacher"),
               OPD_LOG_LEVEL="WARNING", PYTHONPATH=str(REPO), TMPDIR=str(tmp), **{k: str(v) for k, v in extra.items()})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(n: int, *, nodes: int = 1, rank: int = 0, port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "stages.launch", "--num_processes", str(n), "--num_machines", str(nodes),
            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
            str(port or _free_port()), "--"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics" / "train.jsonl").read_text().splitlines()]


def _exports_load_and_generate(ckpt_dir: Path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = sorted(p.name for p in ckpt_dir.iterdir())
    for name in names:
        m = AutoModelForCausalLM.from_pretrained(ckpt_dir / name)
        tok = AutoTokenizer.from_pretrained(ckpt_dir / name)
        ids = tok("1 + 1 =", return_tensors="pt").input_ids
        assert m.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    return names


def test_two_processes_train_the_one_process_step(models, tmp_path):
    cmd = ["-m", "stages.train", "--config", str(REPO / "configs" / "demo_cpu.yaml"), *TRAIN, "--debug_max_steps", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = subprocess.run([sys.executable, *cmd], cwd=REPO, env=_env(models, one), capture_output=True, text=True,
                        timeout=600)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = subprocess.run([*_launch(2), *cmd[2:]], cwd=REPO, env=_env(models, two), capture_output=True, text=True,
                        timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "completions/step=16 processes=2 (a step = 2 x 8 x 1 accumulated)" in r2.stdout
    assert r2.stdout.count("[train] done:") == 1  # rank 0 speaks for the run
    m1, m2 = _metrics(one), _metrics(two)
    assert [m["step"] for m in m2] == [1, 2]  # one line a step, not one a process
    assert m1[0]["sft/off_policy_step"] == m2[0]["sft/off_policy_step"] == 1.0  # step 1: SFT on the solutions
    assert m2[1]["sft/off_policy_step"] == 0.0  # step 2: on-policy (greedy samples: the same completions)
    for a, b in zip(m1, m2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)  # gloo's sums vs one process's: float noise
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    assert m2[1]["kl/sampled_mean"] == pytest.approx(m1[1]["kl/sampled_mean"], rel=1e-4)
    assert _exports_load_and_generate(two / "checkpoints") == ["checkpoint-2"]  # one set, written once
    assert not list((two / "checkpoints").glob(".tmp-*"))


def test_sigterm_to_run_sh_under_the_launcher_saves_once_and_exits_143(models, tmp_path):
    out = tmp_path / "run"
    env = _env(models, out)
    # a resume state saved by one process: run.sh then skips stage one (training began on this curriculum) and
    # the two processes resume it
    r = subprocess.run([sys.executable, "-m", "stages.train", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
                        *TRAIN, "--debug_max_steps", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import yaml

    cfg = tmp_path / "train.yaml"  # the command line above as a recipe
    y = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    y.update({k[2:]: yaml.safe_load(v) for k, v in zip(TRAIN[::2], TRAIN[1::2])})
    cfg.write_text(yaml.safe_dump(y))
    env.update(TRAIN_CONFIG=str(cfg), EVAL_PROTOCOLS="", OPD_NUM_PROCESSES="2", MAX_WALL_TIME_SECONDS="3000",
               MASTER_PORT=str(_free_port()))
    p = subprocess.Popen(["bash", "run.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    seen, t0 = [], time.time()
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith("[step 3]"):
                break
            assert time.time() - t0 < 600, "".join(seen[-30:])
        os.kill(p.pid, signal.SIGTERM)
        rest, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = "".join(seen) + rest
    assert p.returncode == 143, log[-3000:]
    assert "curate: skipped, training has state" in log and "stages.launch --num_processes 2" in log
    assert "saved by 1 process(es), on 2: each step keeps the recipe's batch" in log
    assert log.count("[train] SIGTERM: stopping after step") == 1  # one line for the run, not one a process
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stop_reason"] == "sigterm" and summary["global_step"] >= 3
    names = _exports_load_and_generate(out / "checkpoints")
    assert names[-1] == f"checkpoint-{summary['global_step']}" and len(names) <= 3  # the step it finished, saved
    assert not (out / ".opd.lock").exists()  # released
    assert wait_gone(str(out), timeout=30) == []  # no training process left


def test_two_nodes_on_localhost_train_and_export(models, tmp_path):
    out = tmp_path / "run"
    port = _free_port()
    cmd = ["--config", str(REPO / "configs" / "demo_cpu.yaml"), *TRAIN, "--debug_max_steps", "2"]
    procs = [subprocess.Popen([*_launch(2, nodes=2, rank=r, port=port), *cmd], cwd=REPO,
                              env=_env(models, out, NODE_RANK=r, NNODES=2), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "processes=2" in logs[0] and "[train] done:" not in logs[1]  # global rank 0 is on node 0
    assert [m["step"] for m in _metrics(out)] == [1, 2]
    assert _exports_load_and_generate(out / "checkpoints") == ["checkpoint-2"]


def test_a_process_that_dies_stops_the_run_with_one_line(models, tmp_path):
    out = tmp_path / "run"
    cmd = ["--config", str(REPO / "configs" / "demo_cpu.yaml"), *TRAIN]
    p = subprocess.Popen([*_launch(2), *cmd], cwd=REPO, env=_env(models, out), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        while not (out / "metrics" / "train.jsonl").exists() or not _metrics(out):  # training is under way
            assert time.time() - t0 < 600 and p.poll() is None
            time.sleep(0.5)
        rank1 = [pid for pid in processes_mentioning(str(out)) if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()
                 and b"stages.train" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        log, _ = p.communicate(timeout=120)  # torchrun stops the other within its 30 s: no hang at a collective
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 137, log[-3000:]
    line = [x for x in log.splitlines() if x.startswith("opd launch:")]
    assert len(line) == 1 and f"rank 1 (local rank 1, pid {rank1[0]}) was killed by SIGKILL first" in line[0]
    assert "Traceback" not in log
    assert wait_gone(str(out), timeout=30) == []
