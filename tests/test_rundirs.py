"""Where a run writes (data_tools/rundirs.py, run.sh): the formal layout under /out, the scratch environment when /tmp
is small, exports that never appear half written or half deleted, and .ci/small_tmp.sh's measurement."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from data_tools import rundirs
from data_tools.rundirs import SmallFs, default_ckpt_dir, default_output_dir, scratch_env

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


# ------------------------------------------------------------------------------------------- run directories

def test_output_and_checkpoint_dirs_follow_the_formal_root_when_it_exists(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    formal = {"OPD_FORMAL_OUT": str(root), "HOME": str(tmp_path / "home")}
    assert default_output_dir("opd_r1_distill_1p5b", formal) == root / "opd" / "opd_r1_distill_1p5b"
    assert default_output_dir(None, dict(formal, EXPERIMENT_NAME="x")) == root / "opd" / "x"
    assert default_ckpt_dir(None, formal) == root / "checkpoints"
    assert default_ckpt_dir(root / "opd" / "x", formal) == root / "checkpoints"  # a run under the root exports there
    # set variables win; a run directory named elsewhere keeps its exports with it
    assert default_output_dir("x", dict(formal, OUTPUT_DIR="/scratch/r")) == Path("/scratch/r")
    assert default_ckpt_dir("/scratch/r", dict(formal, OUTPUT_DIR="/scratch/r")) == Path("/scratch/r/checkpoints")
    assert default_ckpt_dir(None, dict(formal, CKPT_DIR="/ck")) == Path("/ck")


def test_without_a_formal_root_the_run_lives_in_the_cache(tmp_path):
    home = tmp_path / "home"
    for root in ("", str(tmp_path / "missing"), str(tmp_path / "a-file")):  # off, absent, not a directory
        (tmp_path / "a-file").write_text("")
        env = {"OPD_FORMAL_OUT": root, "HOME": str(home)}
        assert rundirs.formal_root(env) is None
        assert default_output_dir("demo", env) == home / ".cache" / "opd" / "runs" / "demo"
        assert default_ckpt_dir(None, env) == home / ".cache" / "opd" / "runs" / "default" / "checkpoints"
    env = {"OPD_FORMAL_OUT": "", "HOME": str(home), "XDG_CACHE_HOME": "/xdg"}
    assert default_output_dir("demo", env) == Path("/xdg/opd/runs/demo")
    assert default_output_dir("demo", dict(env, OPD_CACHE="/c")) == Path("/c/runs/demo")


def test_runio_preflight_and_run_sh_share_the_rule(tmp_path):
    """runio re-exports rundirs' functions; the preflight's plan and run.sh's assignments give the same directories."""
    from data_tools import runio
    from data_tools.preflight import resolve_plan

    assert (runio.default_output_dir, runio.default_ckpt_dir, runio.cache_root) == \
        (rundirs.default_output_dir, rundirs.default_ckpt_dir, rundirs.cache_root)
    root = tmp_path / "out"
    root.mkdir()
    env = {"OPD_FORMAL_OUT": str(root), "EXPERIMENT_NAME": "opd_r1_distill_1p5b", "OPD_SMALL_TMP": "0",
           "HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    plan = resolve_plan(str(REPO / "configs/curate_demo_cpu.yaml"), str(REPO / "configs/demo_cpu.yaml"), [], env)
    assert (plan.output_dir, plan.ckpt_dir) == (root / "opd" / "opd_r1_distill_1p5b", root / "checkpoints")
    printed = subprocess.run(
        ["bash", "-c", f'eval "$({sys.executable} -m data_tools.rundirs shell --experiment opd_r1_distill_1p5b)"; '
                       'echo "$OUTPUT_DIR|$CKPT_DIR|${#SCRATCH[@]}|$SCRATCH_NOTE"'],
        cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    assert printed == f"{root}/opd/opd_r1_distill_1p5b|{root}/checkpoints|0|\n"


# ------------------------------------------------------------------------------------------- small /tmp

def _statvfs(small_prefix: str, total: int = 256 * MIB, free: int = 250 * MIB):
    """os.statvfs for a machine whose file system under ``small_prefix`` is small (others 100 GiB, half free)."""
    def fake(path):
        t, f = (total, free) if path.startswith(small_prefix) else (100 << 30, 50 << 30)
        return SimpleNamespace(f_blocks=t // 4096, f_bavail=f // 4096, f_frsize=4096)
    return fake


def test_small_tmp_with_home_on_it_moves_temp_files_home_and_every_cache_under_output_dir(tmp_path):
    out = tmp_path / "run"
    env = {"HOME": "/tmp", "TMPDIR": "/tmp", "HF_HOME": "/tmp/hf"}
    small = SmallFs(env, statvfs=_statvfs("/tmp"))
    exports, line = scratch_env(out, env, small)
    user = rundirs._user()
    assert exports == {
        "TMPDIR": f"{out}/tmp", "TORCHINDUCTOR_CACHE_DIR": f"{out}/tmp/torchinductor_{user}",
        "TIKTOKEN_CACHE_DIR": f"{out}/tmp/data-gym-cache",
        "HOME": f"{out}/home", "XDG_CACHE_HOME": f"{out}/home/.cache", "XDG_CONFIG_HOME": f"{out}/home/.config",
        "OPD_CACHE": f"{out}/home/.cache/opd",
        "HF_HOME": f"{out}/home/.cache/huggingface",  # set, but into the small /tmp: replaced
        "HF_DATASETS_CACHE": f"{out}/home/.cache/huggingface/datasets", "TORCH_HOME": f"{out}/home/.cache/torch",
        "TORCH_EXTENSIONS_DIR": f"{out}/home/.cache/torch_extensions", "TRITON_CACHE_DIR": f"{out}/home/.triton/cache",
        "VLLM_CACHE_ROOT": f"{out}/home/.cache/vllm", "VLLM_CONFIG_ROOT": f"{out}/home/.config/vllm",
        "VLLM_ASSETS_CACHE": f"{out}/home/.cache/vllm/assets", "FLASHINFER_WORKSPACE_BASE": f"{out}/home",
        "CUDA_CACHE_PATH": f"{out}/home/.nv/ComputeCache", "NUMBA_CACHE_DIR": f"{out}/home/.cache/numba",
        "MPLCONFIGDIR": f"{out}/home/.config/matplotlib", "PIP_CACHE_DIR": f"{out}/home/.cache/pip",
        "UV_CACHE_DIR": f"{out}/home/.cache/uv"}
    assert line.startswith("/tmp is small (256 MiB, 250 MiB free); HOME=/tmp lies on it: temp files go to "
                           f"{out}/tmp and HOME and its caches to {out}/home (exported: TMPDIR ")


def test_small_tmp_alone_moves_temp_files_and_keeps_home():
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat("/tmp").st_dev:
        pytest.skip("needs a HOME on another file system than /tmp (/dev/shm)")
    env = {"HOME": str(shm), "TORCHINDUCTOR_CACHE_DIR": str(shm / "inductor")}  # set off the small /tmp: kept
    exports, line = scratch_env("/r", env, SmallFs(env, statvfs=_statvfs("/tmp", total=100 << 30, free=MIB)))
    assert exports == {"TMPDIR": "/r/tmp", "TIKTOKEN_CACHE_DIR": "/r/tmp/data-gym-cache"}
    assert line == "/tmp is small (100 GiB, 1 MiB free): temp files go to /r/tmp (exported: TMPDIR TIKTOKEN_CACHE_DIR)"


def test_large_tmp_exports_nothing_and_the_switch_forces_or_stops_it():
    env = {"HOME": "/tmp"}
    assert scratch_env("/r", env, SmallFs(env, statvfs=_statvfs("/nowhere"))) == ({}, "")
    forced = dict(env, OPD_SMALL_TMP="1")
    exports, line = scratch_env("/r", forced, SmallFs(forced, statvfs=_statvfs("/nowhere")))
    assert exports["TMPDIR"] == "/r/tmp" and exports["HOME"] == "/r/home"
    assert line.startswith("/tmp is treated as small (OPD_SMALL_TMP=1)")
    off = dict(env, OPD_SMALL_TMP="0")
    assert scratch_env("/r", off, SmallFs(off, statvfs=_statvfs("/tmp"))) == ({}, "")
    with pytest.raises(ValueError, match="OPD_SMALL_TMP must be auto, 1 or 0, got 'yes'"):
        SmallFs({"OPD_SMALL_TMP": "yes"})


def _stub_python(tmp_path: Path) -> Path:
    """An OPD_PYTHON that answers run.sh's rundirs question with the real interpreter and, at the preflight (the first
    thing run after the exports), writes its environment to env.txt and stops the run."""
    stub = tmp_path / "py"
    stub.write_text(f'#!/bin/sh\n[ "$2" = data_tools.rundirs ] && exec "{sys.executable}" "$@"\n'
                    f'env > "{tmp_path}/env.txt"; exit 2\n')
    stub.chmod(0o755)
    return stub


def test_run_sh_exports_the_scratch_environment_before_anything_runs_and_plan_only_prints_it(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    base = {k: v for k, v in os.environ.items() if k not in ("OUTPUT_DIR", "CKPT_DIR", "TMPDIR", "XDG_CACHE_HOME",
                                                             "HF_HOME", "OPD_CACHE", "STUDENT_MODEL")}
    env = dict(base, OPD_FORMAL_OUT=str(root), OPD_SMALL_TMP="1", HOME="/tmp", OPD_PYTHON=str(_stub_python(tmp_path)))
    r = subprocess.run(["bash", str(REPO / "run.sh")], env=env, capture_output=True, text=True, timeout=60)
    run = root / "opd" / "default"
    assert r.returncode == 2, r.stderr
    assert r.stdout.startswith(f"run.sh: /tmp is treated as small (OPD_SMALL_TMP=1); HOME=/tmp lies on it: temp "
                               f"files go to {run}/tmp and HOME and its caches to {run}/home (exported: TMPDIR "), r.stdout
    seen = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert (seen["OUTPUT_DIR"], seen["CKPT_DIR"]) == (str(run), str(root / "checkpoints"))
    assert (seen["TMPDIR"], seen["HOME"], seen["HF_HOME"], seen["VLLM_CACHE_ROOT"]) == \
        (f"{run}/tmp", f"{run}/home", f"{run}/home/.cache/huggingface", f"{run}/home/.cache/vllm")
    assert (run / "tmp").is_dir() and (run / "home" / ".cache" / "huggingface").is_dir()
    shutil.rmtree(root / "opd")
    (tmp_path / "env.txt").unlink()
    # --plan: the same line, nothing created, nothing exported
    r = subprocess.run(["bash", str(REPO / "run.sh"), "--plan"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "(a run exports these; --plan creates nothing)" in r.stdout, r.stdout + r.stderr
    seen = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert seen["HOME"] == "/tmp" and "TMPDIR" not in seen and not (root / "opd").exists()


# ------------------------------------------------------------------------------------------- sockets, exports

def test_vllm_ipc_folder_leaves_a_temp_dir_too_deep_for_a_unix_socket():
    from data_tools.generation.processes import IPC_NAME_BYTES, SOCKET_PATH_MAX, ipc_root

    fits = "/o/" + "x" * (SOCKET_PATH_MAX - IPC_NAME_BYTES - 3)
    assert ipc_root(fits) == fits
    assert ipc_root(fits + "y") == "/tmp"  # a socket holds no data: even a 256 MiB /tmp takes it
    # the longest path vLLM will bind under it fits the kernel's 107 bytes
    assert len(f"{fits}/opd-vllm-ipc-4194304-abcdefgh/{'u' * 36}") == SOCKET_PATH_MAX


class _FakeModel:
    def save_pretrained(self, d, state_dict=None, safe_serialization=True):
        (Path(d) / "model.safetensors").write_bytes(b"w" * 1000)
        (Path(d) / "config.json").write_text("{}")


class _FakeTokenizer:
    def save_pretrained(self, d):
        (Path(d) / "tokenizer.json").write_text("{}")


def test_exports_are_never_visible_half_written_or_half_deleted(tmp_path, monkeypatch):
    """The formal orchestrator scores checkpoint-* as it finds them: a step's export appears by one rename, and an
    export replaced or rotated out leaves checkpoint-* by one rename before its files are deleted."""
    from trainers import callbacks

    ck = tmp_path / "checkpoints"
    deleted = []
    real_rmtree = shutil.rmtree

    def watch(path, *a, **k):
        path = Path(path)
        if path.exists():
            deleted.append((path.name, sorted(p.name for p in ck.iterdir() if p.name.startswith("checkpoint-"))))
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(callbacks.shutil, "rmtree", watch)
    for step in (1, 2, 3, 3, 4):  # step 3 twice: a re-export replaces it
        callbacks.export_checkpoint(_FakeModel(), _FakeTokenizer(), ck, step, keep=3)
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert len(deleted) == 2 and all(name.startswith(".tmp-checkpoint-") for name, _ in deleted), deleted
    assert deleted[0][1] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # the new step 3 in place, the old aside
    assert deleted[1][1] == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]  # step 1 renamed away before deletion
    assert all((ck / f"checkpoint-{s}" / "model.safetensors").stat().st_size == 1000 for s in (2, 3, 4))


def test_rotation_never_removes_another_runs_exports_and_they_are_named(tmp_path):
    """In a shared exports directory (the formal layout's /out/checkpoints) rotation counts and removes only the
    exports of the run that writes (their opd_checkpoint.json's owner); another run's, and exports that name no
    run, stay, and foreign_exports names them for the trainer's warning."""
    from trainers import callbacks

    ck = tmp_path / "checkpoints"
    (ck / "checkpoint-999").mkdir(parents=True)  # something else's: no opd_checkpoint.json
    callbacks.export_checkpoint(_FakeModel(), _FakeTokenizer(), ck, 500, keep=3, owner="/runs/other")
    for step in (10, 20, 30, 40):
        callbacks.export_checkpoint(_FakeModel(), _FakeTokenizer(), ck, step, keep=3, owner="/runs/me")
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint-20", "checkpoint-30", "checkpoint-40",
                                                    "checkpoint-500", "checkpoint-999"]
    assert callbacks.export_owner(ck / "checkpoint-40") == "/runs/me" and callbacks.export_owner(ck / "checkpoint-999") is None
    assert [p.name for p in callbacks.foreign_exports(ck, "/runs/me")] == ["checkpoint-500", "checkpoint-999"]
    assert [p.name for p in callbacks.foreign_exports(ck, "/runs/other")] == [
        "checkpoint-20", "checkpoint-30", "checkpoint-40", "checkpoint-999"]
    callbacks.rotate_exports(ck, 1)  # no owner: every export counts (the behaviour for callers that name none)
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint-999"]


def test_a_fresh_training_gets_a_new_owner_a_resumed_one_keeps_it_and_stale_exports_are_set_aside(tmp_path):
    """The id a training's exports name: new on each fresh start in the same run directory (the exports a former
    training left there are then not its own), the same on resume; a resumed run with no id yet adopts the exports
    that name no run. set_aside renames exports out of checkpoint-* to a free stale- name, files kept."""
    from trainers import callbacks

    run, ck = tmp_path / "run", tmp_path / "checkpoints"
    a, adopted = callbacks.start_owner(run, resuming=False)
    assert a.startswith(f"{run.resolve()}#") and not adopted
    assert callbacks.start_owner(run, resuming=True) == (a, False)
    b, _ = callbacks.start_owner(run, resuming=False)
    assert b != a and callbacks.owner_file(run).read_text().strip() == b
    callbacks.export_checkpoint(_FakeModel(), _FakeTokenizer(), ck, 50, keep=3, owner=a)  # the former training's
    (ck / "checkpoint-7").mkdir()                                                        # an export naming no run
    assert [p.name for p in callbacks.foreign_exports(ck, b)] == ["checkpoint-7", "checkpoint-50"]
    assert [p.name for p in callbacks.foreign_exports(ck, b, unnamed_are_mine=True)] == ["checkpoint-50"]
    (ck / "stale-checkpoint-50").mkdir()
    moved = callbacks.set_aside(callbacks.foreign_exports(ck, b))
    assert [p.name for p in moved] == ["stale-checkpoint-7", "stale-checkpoint-50.1"]
    assert sorted(p.name for p in ck.iterdir()) == ["stale-checkpoint-50", "stale-checkpoint-50.1", "stale-checkpoint-7"]
    assert (ck / "stale-checkpoint-50.1" / "model.safetensors").stat().st_size == 1000
    callbacks.owner_file(run).unlink()  # a run from before exports named it, resumed: adopts the unnamed ones
    c, adopted = callbacks.start_owner(run, resuming=True)
    assert adopted and c not in (a, b)


# ------------------------------------------------------------------------------------------- .ci/small_tmp.sh

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason=".ci/small_tmp.sh needs root and unshare (a mount namespace, a tmpfs)")


@needs_root
def test_small_tmp_script_measures_the_peak_and_fails_over_the_limit(tmp_path):
    script = str(REPO / ".ci" / "small_tmp.sh")
    env = dict(os.environ, SMALL_TMP_LIMIT_MIB="4", SMALL_TMP_SAMPLE_S="0.05")
    env.pop("OPD_CACHE", None)
    # 8 MiB for 1.5 s (the sampler starts within it), then removed: the peak catches it, nothing is left
    r = subprocess.run([script, "bash", "-c", 'test "$HOME" = /tmp && test "$TMPDIR" = /tmp && test -z "$(ls -A /tmp)" '
                        '&& head -c 8M /dev/zero > /tmp/x && sleep 1.5 && rm /tmp/x'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "/tmp peak 8.00 MiB (8192 KiB), left 0.00 MiB (0 KiB) (limit 4 MiB)" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([script, "bash", "-c", "head -c 1M /dev/zero > /tmp/y; exit 7"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 7 and "left 1.00 MiB (1024 KiB)" in r.stdout and "the command failed (exit 7)" in r.stderr
    # a path under the host's /tmp named in OPD_CACHE stays reachable, on the host's disk (not counted)
    keep = tmp_path / "cache"
    r = subprocess.run([script, "bash", "-c", f'head -c 6M /dev/zero > "{keep}/z"'], env=dict(env, OPD_CACHE=str(keep)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "peak 0.00 MiB (0 KiB)" in r.stdout and "passed" in r.stdout, r.stdout + r.stderr
    assert (keep / "z").stat().st_size == 6 * MIB


def test_preflight_refuses_a_run_directory_on_the_small_tmp():
    """HOME=/tmp on a small tmpfs, no /out, no OUTPUT_DIR: the run's own directory would land on the tmpfs and fill it
    hours in; the preflight refuses it in one line instead of warning (/tmp treated as small: OPD_SMALL_TMP=1)."""
    from types import SimpleNamespace

    from data_tools import preflight

    out = Path("/tmp/opd-never-created/runs/default")  # its nearest existing ancestor is /tmp itself: nothing is made
    for env, refused in (({"OPD_SMALL_TMP": "1"}, True), ({"OPD_SMALL_TMP": "0"}, False)):
        rep = preflight.Report()
        preflight.check_small_tmp(rep, SimpleNamespace(output_dir=out, ckpt_dir=out / "checkpoints"), env)
        assert len(rep.refusals) == (1 if refused else 0) and rep.warnings == []
        if refused:
            assert rep.refusals[0].startswith(f"OUTPUT_DIR {out} and CKPT_DIR") and "set OUTPUT_DIR" in rep.refusals[0]
    assert not out.parent.parent.exists()
