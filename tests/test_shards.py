"""Stage one and evaluation over several engine processes (``workers``, ``NNODES`` / ``NODE_RANK``).

Fast: the worker pool (one line naming a failed worker, signals passed on, no worker outliving a killed
parent), GPU slices, node layout, seeds, the node watch, and earlier leftovers (a failed load leaves no
``parts/``). Slow (a tiny random Llama on the hf engine, one thread per process): 2 workers write the
curriculum 1 worker writes; a killed worker stops the run with one line and a re-run completes it; two
"nodes" on localhost merge one curriculum; evaluation with 2 workers writes the samples of 1.
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_tools.workers import (Worker, WorkerFailed, config_argv, device_slices, node_layout, parse_shard,
                                pop_shard_flag, run_workers)
from tests.faultkit import wait_gone
from tests.test_trainer import tiny_model_dir, tokenizer  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
#: the run contract and the launcher's variables: a test sets what it needs
_SCRUB = ("OUTPUT_DIR", "STUDENT_MODEL", "TEACHER_MODEL", "TRAIN_DATA", "EVAL_DATA", "MAX_WALL_TIME_SECONDS",
          "DEADLINE_RESERVE_SECONDS", "EXPERIMENT_NAME", "NNODES", "NODE_RANK", "OPD_RUN_START", "OPD_LOCK_OWNER",
          "CUDA_VISIBLE_DEVICES")


def _env(**extra) -> dict[str, str]:
    # one thread a process: on 2 shared cores a tiny model's ops are ~10x faster, and the samples are the same
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)} | extra


# ----------------------------------------------------------------------------------- small parts

def test_shard_flag_slices_and_layout():
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "-1/2", "x/2", "1"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    argv = ["--workers", "2", "--shard", "1/2", "--seed", "3"]
    assert pop_shard_flag(argv) == (1, 2) and argv == ["--workers", "2", "--seed", "3"]
    argv = ["--shard=0/3"]
    assert pop_shard_flag(argv) == (0, 3) and argv == []
    assert pop_shard_flag(["--seed", "1"]) is None

    assert device_slices(2, env={}) == ["0", "1"]
    assert device_slices(2, env={"CUDA_VISIBLE_DEVICES": "3, 5,7"}) == ["3", "5"]  # the parent's list, in order
    assert device_slices(2, 2, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == ["4,5", "6,7"]  # tensor parallel slices
    assert device_slices(2, env={"CUDA_VISIBLE_DEVICES": ""}) == ["", ""]  # a CPU run stays on the CPU
    with pytest.raises(ValueError, match="workers=4 x tensor_parallel_size=1 needs 4 GPUs; CUDA_VISIBLE_DEVICES=0,1 lists 2"):
        device_slices(4, env={"CUDA_VISIBLE_DEVICES": "0,1"})

    assert node_layout({}) == (1, 0) and node_layout({"NNODES": "2", "NODE_RANK": "1"}) == (2, 1)
    for bad in ({"NNODES": "2", "NODE_RANK": "2"}, {"NNODES": "0"}, {"NNODES": "two"}):
        with pytest.raises(ValueError, match="NNODES"):
            node_layout(bad)


def test_config_argv_rebuilds_the_config(tmp_path):
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    cfg = CurateConfig(output_dir=str(tmp_path), temperature=0.7, limit=5, workers=2, seed=3)
    argv = config_argv(cfg)
    assert "--limit" in argv and argv[argv.index("--temperature") + 1] == "0.7"
    (again,) = parse_config([CurateConfig], argv, env={"TRAIN_DATA": "synth:test:9"})  # flags win over the env
    assert again == cfg
    assert "--limit" not in config_argv(CurateConfig(output_dir=str(tmp_path)))  # None: left out


def test_derive_seed_is_stable_and_per_part():
    from data_tools.generation.engines import derive_seed

    # sha256, not hash(): the same in every process (PYTHONHASHSEED) and on every machine
    assert derive_seed(0, "teacher", 3) == 1073119288
    assert len({derive_seed(0, r, c) for r in ("teacher", "student") for c in range(50)}) == 100
    assert all(0 <= derive_seed(s, "eval", 1) < 2**31 for s in range(20))


def test_hf_engine_seeds_make_a_call_independent_of_the_calls_before(tiny_model_dir):
    from data_tools.generation.engines import HFEngine

    eng = HFEngine(tiny_model_dir, seed=0, max_model_len=128)
    prompts = ["What is 2 + 3?", "Count: 7, 8,"]
    run = lambda **kw: [(s.prompt_index, s.sample_index, s.completion) for b in eng.generate(prompts, n=3, max_tokens=6, **kw) for s in b]  # noqa: E731
    first = run(seeds=[11, 5])
    run()  # the engine's own stream moves on
    assert run(seeds=[11, 5]) == first
    assert run(seeds=[12, 5]) != first
    with pytest.raises(ValueError, match="seeds: 1 for 2 prompts"):
        run(seeds=[11])


# ---------------------------------------------------------------------------------- worker pool

_SLEEPER = textwrap.dedent("""
    import os, signal, sys, time
    from data_tools.workers import worker_init
    worker_init()
    def stop(signum, frame):
        open(os.environ["MARK"] + "." + signal.Signals(signum).name, "w").close()
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("worker up on", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
""")


def _workers(tmp_path, specs: list[tuple[float, int]]) -> list[Worker]:
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    return [Worker(i, len(specs), [PY, str(script), str(t), str(rc)], str(i), tmp_path / "logs" / f"worker-{i}.log",
                   {"MARK": str(tmp_path / f"w{i}"), "PYTHONPATH": str(REPO)})
            for i, (t, rc) in enumerate(specs)]


def test_a_failed_worker_stops_the_others_with_one_line(tmp_path, capsys):
    t0 = time.time()
    with pytest.raises(WorkerFailed) as e:
        run_workers(_workers(tmp_path, [(60, 0), (1.5, 3)]))
    assert time.time() - t0 < 30  # worker 0 was stopped, not waited out
    assert str(e.value) == f"worker 1/2 (CUDA_VISIBLE_DEVICES=1) exited with code 3; its log: {tmp_path / 'logs' / 'worker-1.log'}"
    assert (tmp_path / "w0.SIGTERM").exists()  # stopped by SIGTERM: its finally blocks ran
    out = capsys.readouterr().out
    assert "[w0/2] worker up on 0" in out and "[w1/2] worker up on 1" in out
    assert "worker up on 1" in (tmp_path / "logs" / "worker-1.log").read_text()


def test_two_workers_output_is_forwarded_line_by_line(tmp_path):
    # two workers print at once into an unbuffered parent (as run.sh's stages run): every forwarded line is whole.
    # print() writes a line and its newline apart, so another worker's line once fell between the two and a
    # finished chunk went missing from the parent's output (CI, 2026-12-05).
    code = "import sys\nfor k in range(4000): print(f'w{sys.argv[1]} line {k} end')"
    parent = ("import sys\nfrom pathlib import Path\nfrom data_tools.workers import Worker, run_workers\n"
              f"run_workers([Worker(i, 2, [sys.executable, '-c', {code!r}, str(i)], str(i), Path({str(tmp_path)!r}) / "
              "f'worker-{i}.log') for i in range(2)])")
    p = subprocess.run([sys.executable, "-c", parent], cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1",
                       "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    bad = [x for x in lines if not re.fullmatch(r"\[w(\d)/2\] w\1 line \d+ end", x)]
    assert bad == [] and len(lines) == 8000
    assert (tmp_path / "worker-1.log").read_text().count(" end\n") == 4000


def test_workers_that_succeed_return(tmp_path):
    run_workers(_workers(tmp_path, [(0.1, 0), (0.3, 0)]))
    assert not list(tmp_path.glob("w*.SIG*"))


_PARENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from data_tools.generation.processes import exit_on_sigterm
    from data_tools.workers import Worker, run_workers
    exit_on_sigterm()
    tmp = Path(sys.argv[1])
    print("parent up", flush=True)
    run_workers([Worker(i, 2, [sys.executable, str(tmp / "sleeper.py"), "60", "0"], str(i), tmp / f"worker-{i}.log",
                        {"MARK": str(tmp / f"w{i}")}) for i in range(2)], stop_timeout_s=20)
""")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_parent_is_passed_on_and_the_parent_exits_after_its_workers(tmp_path, sig, code):
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    (tmp_path / "parent.py").write_text(_PARENT)
    p = subprocess.Popen([PY, str(tmp_path / "parent.py"), str(tmp_path)], env=_env(OPD_TAG=str(tmp_path)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all((tmp_path / f"worker-{i}.log").exists() and "up on" in (tmp_path / f"worker-{i}.log").read_text()
                  for i in range(2)):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.2)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert (tmp_path / f"w0.{sig.name}").exists() and (tmp_path / f"w1.{sig.name}").exists()
    assert wait_gone(str(tmp_path), 10) == []


def test_workers_die_with_a_killed_parent(tmp_path):
    (tmp_path / "sleeper.py").write_text(_SLEEPER)
    (tmp_path / "parent.py").write_text(_PARENT)
    p = subprocess.Popen([PY, str(tmp_path / "parent.py"), str(tmp_path)], env=_env(OPD_TAG=str(tmp_path)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not all((tmp_path / f"worker-{i}.log").exists() and "up on" in (tmp_path / f"worker-{i}.log").read_text()
                  for i in range(2)):
        assert time.time() < deadline
        time.sleep(0.2)
    p.kill()
    p.wait()
    assert wait_gone(str(tmp_path), 20) == []
    assert (tmp_path / "w0.SIGTERM").exists() and (tmp_path / "w1.SIGTERM").exists()  # PR_SET_PDEATHSIG


# ------------------------------------------------------------------------------- multi-node watch

def test_node_watch_names_a_failed_or_silent_node(tmp_path, monkeypatch):
    from data_tools.runio import write_json
    from stages.curate_nodes import NodeWatch as _NodeWatch, ShardFailed

    monkeypatch.setenv("OPD_NODE_STALL_S", "0.3")
    w = _NodeWatch(tmp_path)
    w.check(1, "run-a", "waiting")  # no file yet: the clock starts
    time.sleep(0.4)
    with pytest.raises(ShardFailed, match=r"node 1 \(NODE_RANK=1\) never reported for \d+s while waiting"):
        w.check(1, "run-a", "waiting")
    write_json({"run_id": "run-a", "state": "measuring", "seq": 1}, tmp_path / "node-2.json")
    w.check(2, "run-a", "waiting")
    time.sleep(0.2)
    write_json({"run_id": "run-a", "state": "measuring", "seq": 2}, tmp_path / "node-2.json")
    time.sleep(0.2)
    w.check(2, "run-a", "waiting")  # it changed: alive
    time.sleep(0.4)
    with pytest.raises(ShardFailed, match=r"node 2 \(NODE_RANK=2\) stopped reporting \(last state: measuring\)"):
        w.check(2, "run-a", "waiting")
    write_json({"run_id": "old-run", "state": "failed", "error": "x", "seq": 9}, tmp_path / "node-3.json")
    w.check(3, "run-a", "waiting")  # an earlier run's failure is not this run's
    write_json({"run_id": "run-a", "state": "failed", "error": "worker 5/8 (CUDA_VISIBLE_DEVICES=1) exited with code 1",
                "host": "h2", "seq": 3}, tmp_path / "node-3.json")
    with pytest.raises(ShardFailed, match=r"node 3 \(NODE_RANK=3, h2\) failed: worker 5/8"):
        w.check(3, "run-a", "waiting")


# --------------------------------------------------------------------------------- leftovers of a failed load

@pytest.mark.parametrize("row, error", [({"problem": "What is 1 + 1?", "answer": ""}, "no usable problems"),
                                        ({"problem": "What is 1 + 1?"}, "need a problem column")])
def test_a_failed_load_leaves_no_parts_dir(tmp_path, row, error):
    import stages.curate as C

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=error):
        C.curate(C.CurateConfig(train_data=str(bad), output_dir=str(out)))
    assert not (out / "curate" / "parts").exists() and not (out / "curate").exists()


def test_a_conflicting_duplicate_is_counted_once(tmp_path):
    from data_tools.problems import load_problems

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "problem": "What is 2+2?", "answer": "4"}, {"id": "b", "problem": "What is 2+2?", "answer": "5"},
        {"id": "c", "problem": "What is 3+3?", "answer": "6"}, {"id": "d", "problem": "what is 3+3?", "answer": "6"}]))
    res = load_problems(f)
    assert (res.duplicates, res.conflicts, len(res.rejects)) == (1, 1, 2)  # b: a conflict only; d: a duplicate
    assert "(1 duplicates, 1 duplicates with a conflicting answer)" in res.report()


# --------------------------------------------------------------------------- real runs (slow)

PROBLEMS = [(0, 1), (1, 1), (0, 2), (2, 0), (1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (1, 0)]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer that writes "1", "2" or EOS (a constant direction in its
    residual stream, read only by those rows of its head), so answers 1 and 2 come out right now and then,
    and 10 problems "Problem i: what is a + b?" with such answers."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from data_tools.models import resolve_model

    root = tmp_path_factory.mktemp("shards")
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.model.embed_tokens.weight[:, 0] = 30.0
        m.lm_head.weight.zero_()
        m.lm_head.weight[[tok.convert_tokens_to_ids(c) for c in "12"], 0] = 3.0
        m.lm_head.weight[tok.eos_token_id, 0] = 3.0 + 0.17  # EOS about as likely as a digit
    m.generation_config.eos_token_id = tok.eos_token_id
    m.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    data = root / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"Problem {i}: what is {a} + {b}?", "answer": str(a + b)})
                            + "\n" for i, (a, b) in enumerate(PROBLEMS)))
    return {"root": root, "model": str(root / "model"), "data": str(data)}


def _curate(digits, out: Path, workers: int = 1, env: dict | None = None, **popen) -> subprocess.Popen:
    cmd = [PY, "-m", "stages.curate", "--train_data", digits["data"], "--student_model", digits["model"],
           "--teacher_context", "privileged", "--privileged_reference", "answer", "--prompt_style", "short",
           "--teacher_samples", "4", "--student_samples", "4", "--max_tokens", "5", "--max_model_len", "256",
           "--chunk_size", "2", "--engine", "hf", "--answer_filter", "numeric", "--zero_pass_share", "1.0",
           "--workers", str(workers), "--output_dir", str(out)]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def _done(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def _tables(out: Path) -> dict[str, list[dict]]:
    """curriculum, rollouts (less their timestamps) and rejects of a run, to compare whole."""
    cur = out / "curate"
    roll = pq.read_table(cur / "rollouts.parquet").drop_columns(["started_at", "finished_at"])
    return {"curriculum": pq.read_table(cur / "curriculum.parquet").to_pylist(), "rollouts": roll.to_pylist(),
            "rejects": pq.read_table(cur / "rejects.parquet").to_pylist()}


@pytest.fixture(scope="module")
def one_worker(digits):
    out = digits["root"] / "one"
    rc, stdout, err = _done(_curate(digits, out))
    assert rc == 0, err[-3000:]
    t = _tables(out)
    # the reference is worth comparing: every problem measured, some kept with a pass rate above 0
    assert len({r["problem_id"] for r in t["rollouts"]}) == 10 and len(t["rollouts"]) == 10 * 8
    assert t["curriculum"] and any(r["pass_rate"] > 0 for r in t["curriculum"]), t["curriculum"]
    return t


@pytest.mark.slow
def test_two_workers_write_the_curriculum_of_one(digits, one_worker):
    out = digits["root"] / "two"
    rc, stdout, err = _done(_curate(digits, out, workers=2))
    assert rc == 0, err[-3000:]
    assert _tables(out) == one_worker  # same problem ids, pass rates, order, buckets; every sample the same
    m = json.loads((out / "curate" / "manifest.json").read_text())
    w = m["workers"]
    assert (w["workers"], w["nnodes"], w["shards"], w["missing_shards"]) == (2, 1, 2, [])
    assert [(s["shard"], s["cuda_visible_devices"], s["chunks"], s["chunks_measured"], s["problems_measured"])
            for s in w["per_shard"]] == [(0, "0", 3, 3, 6), (1, "1", 2, 2, 4)]  # chunks 0,2,4 and 1,3 of 5
    assert m["budget"]["chunks_measured"] == 5 and m["budget"]["stop_reason"] == "every problem measured"
    assert "[w0/2] [teacher] chunk 1/5 -> teacher-00000.parquet" in stdout
    assert "[w1/2] [student] chunk 2/5 -> student-00001.parquet" in stdout
    log1 = (out / "curate" / "workers" / "worker-1.log").read_text()
    assert "chunk 4/5 -> student-00003.parquet" in log1 and "chunk 1/5" not in log1


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_in_one_line_and_a_rerun_completes_it(digits, one_worker):
    out = digits["root"] / "killed"
    parts = out / "curate" / "parts"
    rc, stdout, err = _done(_curate(digits, out, workers=2, env={"OPD_TEST_CURATE_SHARD_EXIT": "1"}))
    log1 = out / "curate" / "workers" / "worker-1.log"
    assert rc == 1
    assert err.strip() == (f"opd curate: error: worker 1/2 (CUDA_VISIBLE_DEVICES=1) exited with code 9; its log: {log1}; "
                           "finished chunks of every shard are kept, a re-run resumes them all")
    assert wait_gone(str(out), 20) == []  # worker 0 was stopped and its engine with it
    # every chunk a worker reported finished is on disk: worker 1's first, and worker 0's up to its SIGTERM
    reported = {line.split("-> ")[1].split(":")[0] for line in stdout.splitlines() if "] chunk " in line and "-> " in line}
    assert {"teacher-00001.parquet", "student-00001.parquet"} <= reported
    assert reported <= {p.name for p in parts.glob("*.parquet")}
    kept = {p.name: p.stat().st_mtime_ns for p in parts.glob("*.parquet")}
    rc, stdout, err = _done(_curate(digits, out, workers=2))
    assert rc == 0, err[-3000:]
    assert "[curate] resuming:" in stdout
    assert {p.name: p.stat().st_mtime_ns for p in parts.glob("*.parquet") if p.name in kept} == kept  # not redone
    assert _tables(out) == one_worker


@pytest.mark.slow
def test_two_nodes_on_localhost_merge_one_curriculum(digits, one_worker):
    out = digits["root"] / "nodes"
    # an earlier run's files, which this run must not take for its own
    fp = json.loads((digits["root"] / "one" / "curate" / "manifest.json").read_text())["fingerprint"]
    stale = out / "curate" / "shards"
    stale.mkdir(parents=True)
    (stale / "run.json").write_text(json.dumps({"run_id": "old", "fingerprint": fp, "time": time.time() - 3600}))
    (stale / "shard-1-of-2.json").write_text(json.dumps({"run_id": "old", "shard": 1, "shards": 2}))
    (stale / "node-1.json").write_text(json.dumps({"run_id": "old", "state": "failed", "error": "old", "seq": 1}))
    nodes = []
    for r in (1, 0):  # each node's run.sh has its own clock start, as on two machines
        nodes.append(_curate(digits, out, env={"NNODES": "2", "NODE_RANK": str(r), "OPD_RUN_START": f"{time.time():.3f}"}))
        time.sleep(2)
    (rc1, out1, err1), (rc0, out0, err0) = [_done(p) for p in nodes]
    assert (rc0, rc1) == (0, 0), (err0[-2000:], err1[-2000:])
    assert _tables(out) == one_worker
    m = json.loads((out / "curate" / "manifest.json").read_text())
    assert (m["workers"]["nnodes"], m["workers"]["shards"]) == (2, 2)
    assert [s["chunks_measured"] for s in m["workers"]["per_shard"]] == [3, 2]
    assert "[curate] node 0 merged the curriculum:" in out1 and "curate done" not in out1
    run_id = json.loads((stale / "run.json").read_text())["run_id"]
    assert run_id != "old" and m["run_id"] == run_id
    for r in (0, 1):  # each node's state file of this run, and its done record
        assert json.loads((stale / f"node-{r}.json").read_text())["state"] == "done"
        assert json.loads((stale / f"shard-{r}-of-2.json").read_text())["run_id"] == run_id
    assert not (out / ".opd.lock").exists()  # node 0's lock released; node 1 took none


@pytest.mark.slow
def test_evaluation_with_two_workers_writes_the_samples_of_one(digits):
    def run(workers: int) -> tuple[dict, list[dict], list[dict]]:
        out = digits["root"] / f"eval{workers}"
        cmd = [PY, "-m", "stages.evaluate", "--protocol", "synth_heldout", "--model", digits["model"],
               "--eval_data", digits["data"], "--n_samples", "4", "--max_tokens", "5", "--chunk_size", "3",
               "--engine", "hf", "--label", "x", "--workers", str(workers), "--output_dir", str(out)]
        p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        res = out / "eval" / "x"
        assert sorted(f.name for f in res.iterdir() if f.is_file()) == ["problems.parquet", "samples.parquet", "summary.json"]
        return (json.loads((res / "summary.json").read_text()), pq.read_table(res / "samples.parquet").to_pylist(),
                pq.read_table(res / "problems.parquet").to_pylist())

    s1, samples1, problems1 = run(1)
    s2, samples2, problems2 = run(2)
    assert samples2 == samples1 and len(samples1) == 40 and problems2 == problems1
    keys = ("pass_at_1", "pass_at_1_stderr", "clip_rate", "n_problems", "n_samples", "pass_at_k", "grader_paths",
            "tokens_generated", "mean_completion_tokens", "problems_all_correct", "problems_none_correct")
    assert {k: s2[k] for k in keys} == {k: s1[k] for k in keys}
    assert 0 < s1["pass_at_1"] < 1
    assert s1["pass_at_1"] == pytest.approx(sum(r["correct"] for r in samples1) / 40)  # computed once, over all
    assert (s1["engine"]["workers"], s2["engine"]["workers"]) == (1, 2)
    assert [(r["problem_index"], r["sample_index"]) for r in samples2] == [(i, j) for i in range(10) for j in range(4)]
