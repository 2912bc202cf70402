"""Where a run writes: its directories' defaults, and the scratch environment for a machine with a small /tmp.

Standard library only: ``run.sh`` asks this module for its defaults (``python3 -m data_tools.rundirs shell``) before
any package is installed, and ``data_tools.runio`` re-exports the same functions, so the shell and the stages follow
one rule.

**Run directories.** ``OUTPUT_DIR`` and ``CKPT_DIR`` win when set. Otherwise:

- on a machine with the formal layout (``/out`` an existing writable directory; ``OPD_FORMAL_OUT`` names another
  root, empty turns the layout off) the run lives in ``/out/opd/<EXPERIMENT_NAME>`` and its HF exports go to
  ``/out/checkpoints/checkpoint-<step>/``, where the formal orchestrator scores them;
- elsewhere the run lives in ``<cache root>/runs/<EXPERIMENT_NAME>`` (cache root: ``$OPD_CACHE``, else
  ``$XDG_CACHE_HOME/opd``, else ``~/.cache/opd``) and its exports in ``<OUTPUT_DIR>/checkpoints``.

A run directory under the formal root exports to ``<root>/checkpoints`` whoever named it; any other keeps its
exports with it.

**Small /tmp.** The formal machine's /tmp is a 256 MiB tmpfs and HOME=/tmp there, so every library that caches under
``~/.cache`` or writes to the temp directory (HF, inductor, triton, vLLM, matplotlib, tokenizers) would fill it. When
/tmp is small (under 2 GiB total or free; ``OPD_SMALL_TMP=1`` forces it, ``0`` turns it off), temp files go to
``$OUTPUT_DIR/tmp`` (TMPDIR and the caches that default under it), and when HOME lies on a small file system too,
HOME and every cache under it go to ``$OUTPUT_DIR/home`` (the directories each library would pick under that HOME,
named explicitly for libraries that do not read HOME from the environment). A variable already set is kept unless it
points into the small file system. ``PYTHONPYCACHEPREFIX`` stays unset: bytecode goes beside the sources, never to
/tmp, and a prefix would recompile every imported module into the run directory at each start.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Callable, Mapping

#: The environment variable naming the formal layout's root; its default; empty turns the layout off.
FORMAL_OUT_ENV, FORMAL_OUT_DEFAULT = "OPD_FORMAL_OUT", "/out"
#: ``auto`` (default): measure /tmp and HOME; ``1``: treat /tmp (and what lies on its file system) as small; ``0``: never.
SMALL_TMP_ENV = "OPD_SMALL_TMP"
#: A file system smaller than this, or with less than this free, is small.
SMALL_BYTES = 2 << 30

Env = Mapping[str, str]


def _env(env: Env | None) -> Env:
    return os.environ if env is None else env


def formal_root(env: Env | None = None) -> Path | None:
    """The formal layout's root (``$OPD_FORMAL_OUT``, default ``/out``) when it is an existing writable directory."""
    root = _env(env).get(FORMAL_OUT_ENV, FORMAL_OUT_DEFAULT)
    if not root:
        return None
    p = Path(root).expanduser()
    return p if p.is_dir() and os.access(p, os.W_OK | os.X_OK) else None


def _home(env: Env) -> Path:
    return Path(env["HOME"]) if env.get("HOME") else Path.home()


def cache_root(env: Env | None = None) -> Path:
    """``$OPD_CACHE`` or ``$XDG_CACHE_HOME/opd`` (default ``~/.cache/opd``): model cache and default runs."""
    env = _env(env)
    if env.get("OPD_CACHE"):
        return Path(env["OPD_CACHE"]).expanduser()
    xdg = env.get("XDG_CACHE_HOME") or str(_home(env) / ".cache")
    return Path(xdg).expanduser() / "opd"


def default_output_dir(experiment: str | None = None, env: Env | None = None) -> Path:
    """Scratch directory of a run: ``$OUTPUT_DIR``, else ``<formal root>/opd/<name>`` on the formal layout, else
    ``<cache_root>/runs/<name>`` (name: ``experiment``, else ``$EXPERIMENT_NAME``, else ``default``)."""
    env = _env(env)
    if env.get("OUTPUT_DIR"):
        return Path(env["OUTPUT_DIR"]).expanduser()
    name = experiment or env.get("EXPERIMENT_NAME") or "default"
    root = formal_root(env)
    return root / "opd" / name if root else cache_root(env) / "runs" / name


def default_ckpt_dir(output_dir: str | os.PathLike | None = None, env: Env | None = None) -> Path:
    """Where the HF exports go: ``$CKPT_DIR``, else ``<formal root>/checkpoints`` for a run directory under the
    formal root, else ``<output_dir>/checkpoints`` (``output_dir`` default: :func:`default_output_dir`)."""
    env = _env(env)
    if env.get("CKPT_DIR"):
        return Path(env["CKPT_DIR"]).expanduser()
    out = Path(output_dir).expanduser() if output_dir else default_output_dir(env=env)
    root = formal_root(env)
    if root is not None and _under(out, root):
        return root / "checkpoints"
    return out / "checkpoints"


def _under(p: Path, root: Path) -> bool:
    p, root = Path(os.path.abspath(p)), Path(os.path.abspath(root))
    return root in p.parents


# ------------------------------------------------------------------------------------------------ small /tmp

def _existing(p: Path) -> Path:
    p = Path(os.path.abspath(p))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _fs(p: Path, statvfs: Callable) -> tuple[int, int, int]:
    """(device, total bytes, free bytes) of the file system holding ``p`` (its nearest existing ancestor)."""
    q = _existing(p)
    st = statvfs(str(q))
    return os.stat(q).st_dev, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _mib(b: int) -> str:
    return f"{b / (1 << 20):.0f} MiB" if b < 10 << 30 else f"{b / (1 << 30):.0f} GiB"


class SmallFs:
    """The small file systems of this machine (/tmp's, and HOME's when it is small), by device."""

    def __init__(self, env: Env | None = None, statvfs: Callable = os.statvfs):
        env = _env(env)
        mode = (env.get(SMALL_TMP_ENV) or "auto").strip().lower()
        if mode not in ("auto", "1", "0"):
            raise ValueError(f"{SMALL_TMP_ENV} must be auto, 1 or 0, got {env.get(SMALL_TMP_ENV)!r}")
        self.devices: dict[int, str] = {}  # device -> how it was judged small
        if mode == "0":
            return
        for what, p in (("/tmp", Path("/tmp")), ("HOME", _home(env))):
            try:
                dev, total, free = _fs(p, statvfs)
            except OSError:
                continue
            if dev in self.devices:
                continue
            if min(total, free) < SMALL_BYTES:
                self.devices[dev] = f"{what} is small ({_mib(total)}, {_mib(free)} free)"
            elif mode == "1" and what == "/tmp":
                self.devices[dev] = f"/tmp is treated as small ({SMALL_TMP_ENV}=1)"

    def holds(self, path: str | os.PathLike) -> bool:
        """``path`` (or its nearest existing ancestor) lies on one of the small file systems."""
        if not self.devices:
            return False
        try:
            return os.stat(_existing(Path(path))).st_dev in self.devices
        except OSError:
            return False


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def scratch_env(output_dir: str | os.PathLike, env: Env | None = None, small: SmallFs | None = None
                ) -> tuple[dict[str, str], str]:
    """The variables to export when /tmp (or HOME) is small, and the one line that says so; ``({}, "")`` otherwise.

    Temp files (``/tmp`` small): ``TMPDIR`` -> ``<output_dir>/tmp``, with inductor's and tiktoken's caches, which
    default under it. HOME on a small file system: ``HOME`` -> ``<output_dir>/home`` and each library's cache and
    config directory where it would be under that HOME. A variable already set to a path off the small file systems
    is kept.
    """
    env = _env(env)
    small = small or SmallFs(env)
    out = Path(output_dir).expanduser()
    tmp, home = out / "tmp", out / "home"
    cache, config = home / ".cache", home / ".config"
    tmp_small = small.holds("/tmp")
    home_small = small.holds(_home(env))
    want: dict[str, Path] = {}
    if tmp_small:
        want.update(TMPDIR=tmp, TORCHINDUCTOR_CACHE_DIR=tmp / f"torchinductor_{_user()}",
                    TIKTOKEN_CACHE_DIR=tmp / "data-gym-cache")
    if home_small:
        want.update(HOME=home, XDG_CACHE_HOME=cache, XDG_CONFIG_HOME=config, OPD_CACHE=cache / "opd",
                    HF_HOME=cache / "huggingface", HF_DATASETS_CACHE=cache / "huggingface" / "datasets",
                    TORCH_HOME=cache / "torch", TORCH_EXTENSIONS_DIR=cache / "torch_extensions",
                    TRITON_CACHE_DIR=home / ".triton" / "cache", VLLM_CACHE_ROOT=cache / "vllm",
                    VLLM_CONFIG_ROOT=config / "vllm", VLLM_ASSETS_CACHE=cache / "vllm" / "assets",
                    FLASHINFER_WORKSPACE_BASE=home, CUDA_CACHE_PATH=home / ".nv" / "ComputeCache",
                    NUMBA_CACHE_DIR=cache / "numba", MPLCONFIGDIR=config / "matplotlib", PIP_CACHE_DIR=cache / "pip",
                    UV_CACHE_DIR=cache / "uv")
    exports = {k: str(v) for k, v in want.items() if not env.get(k) or small.holds(env[k])}
    if not exports:
        return {}, ""
    why = list(small.devices.values())
    if home_small and len(why) == 1 and tmp_small:
        why.append(f"HOME={_home(env)} lies on it")
    where = [f"temp files go to {tmp}"] * tmp_small + [f"HOME and its caches to {home}"] * home_small
    line = f"{'; '.join(why)}: {' and '.join(where)} (exported: {' '.join(exports)})"
    return exports, line


# ------------------------------------------------------------------------------------------------ for run.sh

def shell(experiment: str, env: Env | None = None) -> str:
    """Bash assignments for ``run.sh``: ``OUTPUT_DIR`` and ``CKPT_DIR`` (the values set, else the defaults), ``SCRATCH``
    (an array of ``VAR=value`` to export) and ``SCRATCH_NOTE`` (its one line, empty when nothing is exported)."""
    env = dict(_env(env))
    out = env.get("OUTPUT_DIR") or str(default_output_dir(experiment, env))
    env["OUTPUT_DIR"] = out
    ckpt = str(default_ckpt_dir(out, env))
    exports, line = scratch_env(out, env)
    q = shlex.quote
    return "\n".join([f"OUTPUT_DIR={q(out)}", f"CKPT_DIR={q(ckpt)}",
                      "SCRATCH=(" + " ".join(q(f"{k}={v}") for k, v in exports.items()) + ")",
                      f"SCRATCH_NOTE={q(line)}"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.rundirs", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["shell"], help="print bash assignments for run.sh")
    ap.add_argument("--experiment", default=None, help="EXPERIMENT_NAME (default: $EXPERIMENT_NAME, else 'default')")
    args = ap.parse_args(argv)
    try:
        sys.stdout.write(shell(args.experiment or os.environ.get("EXPERIMENT_NAME") or "default"))
    except ValueError as e:
        print(f"run.sh: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
