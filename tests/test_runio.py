"""Atomic writes, run locks (exit 75, stale takeover), config precedence, duckdb views."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_tools import runio
from data_tools.config import parse_config
from data_tools.query import connect

REPO = Path(__file__).resolve().parents[1]


def test_atomic_parquet_leaves_no_temp(tmp_path):
    dest = runio.write_parquet([{"a": 1}, {"a": 2}], tmp_path / "sub" / "t.parquet")
    assert pq.read_table(dest).num_rows == 2
    assert [p.name for p in dest.parent.iterdir()] == ["t.parquet"]


def test_failed_write_keeps_old_file(tmp_path):
    dest = runio.write_json({"v": 1}, tmp_path / "m.json")
    import pyarrow as pa

    with pytest.raises(pa.ArrowException):
        runio.write_parquet([{"a": object()}], tmp_path / "m.json")  # arrow cannot encode object()
    assert json.loads(dest.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_lock_held_then_stale(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        runio.acquire_lock(tmp_path, owner_pid=holder.pid)
        with pytest.raises(runio.LockHeld, match=f"pid {holder.pid}"):
            runio.acquire_lock(tmp_path)
        rc = subprocess.run([sys.executable, "-m", "data_tools.runio", "lock", str(tmp_path), "--pid", str(os.getpid())],
                            cwd=REPO, capture_output=True, text=True)
        assert rc.returncode == runio.EXIT_LOCKED == 75
        assert f"pid {holder.pid}" in rc.stderr
    finally:
        holder.kill()
        holder.wait()
    lock = runio.acquire_lock(tmp_path)  # the holder died: its lock is stale and taken over
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    runio.release_lock(lock)
    assert not lock.exists()


def test_output_dir_inside_repo_is_refused():
    with pytest.raises(ValueError, match="inside the repository"):
        runio.check_outside_repo(REPO / "outputs")


@dataclass
class _Cfg:
    train_data: str = field(default="a", metadata={"help": "data"})
    max_wall_time_seconds: float = field(default=10.0, metadata={"help": "wall"})
    lr: float = field(default=1.0, metadata={"help": "lr"})


def test_config_precedence_yaml_env_cli(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("command: ignored\ntrain_data: from_yaml\nmax_wall_time_seconds: 20\nlr: 2.0\n")
    (cfg,) = parse_config([_Cfg], ["--config", str(y)], env={})
    assert (cfg.train_data, cfg.max_wall_time_seconds, cfg.lr) == ("from_yaml", 20, 2.0)
    (cfg,) = parse_config([_Cfg], ["--config", str(y)], env={"TRAIN_DATA": "from_env", "MAX_WALL_TIME_SECONDS": "90"})
    assert (cfg.train_data, cfg.max_wall_time_seconds) == ("from_env", 90.0)
    (cfg,) = parse_config([_Cfg], ["--config", str(y), "--train_data", "from_cli"], env={"TRAIN_DATA": "from_env"})
    assert cfg.train_data == "from_cli"
    y.write_text("train_data: x\nlearning_rat: 3\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rat'\]"):
        parse_config([_Cfg], ["--config", str(y)], env={})


def test_query_views(tmp_path):
    runio.write_parquet([{"problem_id": "p1", "role": "student", "correct": True},
                         {"problem_id": "p1", "role": "student", "correct": False}], tmp_path / "curate" / "rollouts.parquet")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    con, views = connect(tmp_path)
    assert views == ["rollouts", "metrics"]
    assert con.execute("SELECT avg(correct::INT) FROM rollouts").fetchone()[0] == 0.5
    assert con.execute("SELECT sum(loss) FROM metrics").fetchone()[0] == 0.75
    out = subprocess.run([sys.executable, "-m", "data_tools.query", "--run", str(tmp_path), "--csv",
                          "SELECT count(*) AS n FROM rollouts"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["n", "2"]


def test_stale_vllm_ipc_folders_of_dead_processes_are_swept(tmp_path):
    """A stage killed with SIGKILL skips its atexit, leaving its private vLLM socket folder: the next engine start
    removes folders whose pid is gone, and keeps its own process's and unnamed ones."""
    from data_tools.generation.processes import sweep_stale_ipc_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"opd-vllm-ipc-{int(dead.stdout)}-abc"
    live = tmp_path / f"opd-vllm-ipc-{os.getpid()}-def"
    other = tmp_path / "opd-vllm-ipc-xyz"
    for d in (stale, live, other):
        d.mkdir()
        (d / "sock").write_text("")
    assert sweep_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_an_oserror_that_is_not_the_disks_is_the_inputs_exit_2_not_74(tmp_path, monkeypatch, capsys):
    """transformers raises OSError for a model folder without weights: stage one reports it as itself with exit 2,
    not as "cannot write to <run>" with the disk-full code 74; a full disk and a read-only directory stay 74."""
    import errno

    import stages.curate as C
    from data_tools.runio import EXIT_IO, io_failure

    no_weights = OSError("Error no file named model.safetensors, or pytorch_model.bin, found in directory /m.")
    assert io_failure(no_weights, [tmp_path]) is None
    assert io_failure(OSError(errno.ENOSPC, "No space left on device"), [tmp_path]).startswith("disk full")
    assert "is not writable" in io_failure(PermissionError(errno.EACCES, "Permission denied"), [tmp_path])
    for err, rc, said in ((no_weights, 2, "no file named model.safetensors"),
                          (OSError(errno.ENOSPC, "No space left on device"), EXIT_IO, "disk full")):
        monkeypatch.setattr(C, "curate", lambda cfg, e=err: (_ for _ in ()).throw(e))
        assert C.main(["--train_data", "synth:train:4", "--output_dir", str(tmp_path / "run")]) == rc
        assert said in capsys.readouterr().err
