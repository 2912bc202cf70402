"""The sympy step: a cheap pre-screen, plain text -> LaTeX, and math-verify in worker subprocesses
with a per-call deadline, an address-space cap and a verdict cache.

math-verify (and its latex2sympy2_extended) is optional: without it the workers read answers with
the grader's own LaTeX reader (``latex``) and compare them with sympy, and the process logs one
warning line saying so (``backend``).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
from collections import OrderedDict

log = logging.getLogger("data_tools.grader")

# Answers longer / deeper than this never reach sympy: real answers are short, and
# latex2sympy's recursive descent is where nesting bombs hurt.
MAX_ANSWER_CHARS = 600
MAX_BRACE_DEPTH = 40
# Relative tolerance used to veto math-verify's True between two numbers (see _mv_check).
REL_TOL = 1e-6
# Worker start-up (imports sympy + math-verify) is not counted against the per-answer deadline.
WORKER_START_TIMEOUT_S = 60.0
# Address-space cap for a worker: a power tower that sneaks past the pre-screen dies with
# MemoryError instead of taking the machine down.
WORKER_MEM_BYTES = 3 * 1024**3
_CACHE_SIZE = 65536

_ROOT_RE = re.compile(r"\\sqrt\s*\[([^\[\]{}]{1,20})\]\s*([0-9A-Za-z]|\\[A-Za-z]+)")
_SCI_RE = re.compile(r"(?<![\w.\\])([0-9]+(?:\.[0-9]+)?)[eE]([+-]?[0-9]+)(?![\w])")


def _to_latex(s: str) -> str:
    """Rewrite plain-text math a model may write into LaTeX latex2sympy understands.

    e-notation ``4.5e33`` (latex2sympy reads ``1e-5`` as ``1*E - 5``), ``exp(x)``,
    ``sqrt(x)``, ``pi``, ``**`` (math-verify #69 lists these as rejected).
    """
    s = s.replace("\u2212", "-").replace("**", "^")
    s = _SCI_RE.sub(lambda m: f"{m.group(1)}\\times 10^{{{m.group(2)}}}", s)
    s = re.sub(r"(?<![\\A-Za-z])exp\(([^()]*)\)", r"e^{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])sqrt\(([^()]*)\)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\sqrt\s*\(([^()]*)\)", r"\\sqrt{\1}", s)  # "4\sqrt(2)" (Math-Verify #41)
    # A root index without braces takes one token, as TeX does: \sqrt[3]2 is \sqrt[3]{2}, \sqrt[3]27 is 7\sqrt[3]{2}.
    s = _ROOT_RE.sub(r"\\sqrt[\1]{\2}", s)
    s = re.sub(r"(?<![\\A-Za-z])pi(?![A-Za-z])", r"\\pi", s)
    return s


def _too_risky(s: str) -> str | None:
    """Reason an answer must not go to sympy, or None. Cheap, linear in len(s)."""
    if len(s) > MAX_ANSWER_CHARS:
        return "answer too long"
    depth = maxd = 0
    for c in s:
        if c in "{([":
            depth += 1
            maxd = max(maxd, depth)
        elif c in "})]":
            depth -= 1
    if maxd > MAX_BRACE_DEPTH:
        return "nesting too deep"
    # Power towers and big exponents: 9^9^9^9, 2^{10^{100}}, 10^{100000}!
    # A numeric base raised to a power of a number (9^9^9, 2^{3^{4}}, 2^(3)^4) can be astronomically
    # large; x^2+y^2 and e^{-x^2} are fine. 2^{3^2} is refused too: rare, and cheaper than a timeout.
    if re.search(r"[0-9)}]\s*\^\s*[{(]?\s*[-+]?\s*[{(]?[0-9.]+[)}]?\s*\^", s):
        return "power tower"
    for m in re.finditer(r"\^\s*\{?\s*[-+]?([0-9]+)", s):
        if len(m.group(1)) > 4:
            return "huge exponent"
    if re.search(r"[0-9]{6,}\s*!|\^[^!]{0,40}[)}]\s*!", s):
        return "huge factorial"
    if len(re.findall(r"[0-9]", s)) > 400:
        return "too many digits"
    return None


# --------------------------------------------------------------------------------------------
# Which library reads answers: math-verify when installed, else the grader's own reader + sympy
# --------------------------------------------------------------------------------------------

#: Packages the "math_verify" backend needs; without any of them the "sympy" backend is used.
MATH_VERIFY_PACKAGES = ("math_verify", "latex2sympy2_extended")
_BACKEND: str | None = None
_BACKEND_LOCK = threading.Lock()


def _importable(name: str) -> bool:
    """``import name`` would find the package (without importing it); a ``sys.modules[name] = None``
    block counts as not installed."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def backend() -> str:
    """``"math_verify"`` or ``"sympy"`` (math-verify not installed: the grader's own LaTeX reader and
    sympy). Decided once per process; the sympy backend is announced by one warning line."""
    global _BACKEND
    with _BACKEND_LOCK:
        if _BACKEND is None:
            missing = [m for m in MATH_VERIFY_PACKAGES if not _importable(m)]
            _BACKEND = "sympy" if missing else "math_verify"
            if missing:
                _announce(f"{', '.join(missing)} not installed")
        return _BACKEND


def _fall_back(why: str) -> None:
    """A math-verify worker could not import it: use the sympy backend from now on."""
    global _BACKEND
    with _BACKEND_LOCK:
        if _BACKEND != "sympy":
            _BACKEND = "sympy"
            _announce(why)


def _announce(why: str) -> None:
    log.warning("grader: math-verify unavailable (%s); equivalence beyond the exact/numeric rules uses the "
                "grader's own LaTeX reader + sympy (data_tools/grader/README.md gives the agreement)", why)


# --------------------------------------------------------------------------------------------
# Worker subprocess running math-verify (or the sympy reader)
# --------------------------------------------------------------------------------------------


def _worker_loop(backend_name: str = "math_verify") -> None:  # pragma: no cover - runs in the child process
    """Child side: read JSON requests on stdin, answer one JSON line each on stdout.

    Imports in this function and the checks it calls (sympy, math-verify, ``latex``) are made here, in the worker
    process: the grading process never loads sympy or the optional math-verify.
    """
    try:
        import resource  # Unix only (the cap is skipped elsewhere)

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEM_BYTES, WORKER_MEM_BYTES))
    except (ImportError, ValueError, OSError):
        pass

    logging.disable(logging.WARNING)  # math-verify warns once that its timeout is off: we know
    sys.setrecursionlimit(4000)
    ready: dict = {"ready": True, "backend": backend_name}
    if backend_name == "math_verify":
        try:
            from math_verify import LatexExtractionConfig, parse, verify  # optional; in the worker
        except Exception as e:  # noqa: BLE001 - a broken install: say so, serve with the sympy reader
            ready.update(backend="sympy", why=f"import math_verify failed: {type(e).__name__}: {e}"[:200])
        else:
            cfg = [LatexExtractionConfig(boxed_match_priority=0)]
            try:  # the same reading without math-verify's unit stripping, for a second try (_mv_parse)
                from dataclasses import replace

                norm = replace(cfg[0].normalization_config, units=False)
                cfg = (cfg, [LatexExtractionConfig(boxed_match_priority=0, normalization_config=norm)])
            except Exception:  # noqa: BLE001 - a math-verify without the field: one reading
                cfg = (cfg,)
    if ready["backend"] == "sympy":
        from .latex import LatexError, read  # sympy: in the worker

    gold_cache: OrderedDict[str, object] = OrderedDict()
    out = sys.stdout
    out.write(json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if ready["backend"] == "sympy":
                res = _sympy_check(req["gold"], req["pred"], read, LatexError, gold_cache)
            else:
                res = _mv_check(req["gold"], req["pred"], parse, verify, cfg, gold_cache)
        except MemoryError:
            res = {"error": "MemoryError"}
        except Exception as e:  # noqa: BLE001 - a bad answer must never kill the worker loop
            res = {"error": f"{type(e).__name__}: {e}"[:300]}
        out.write(json.dumps(res) + "\n")
        out.flush()


def _scalar_value(x):
    """High-precision complex value of a symbol-free sympy scalar, or None."""
    import sympy  # in the worker (see _worker_loop)

    if not isinstance(x, sympy.Expr) or x.free_symbols or not x.is_number:
        return None
    try:
        v = sympy.N(x, 30)
        complex(v)  # raises for values sympy cannot evaluate to a number
    except Exception:  # noqa: BLE001
        return None
    return v


def _set_size(x):
    import sympy  # in the worker (see _worker_loop)
    from latex2sympy2_extended.sets import FiniteSet

    if isinstance(x, (FiniteSet, sympy.FiniteSet)):
        return len(x.args)
    if isinstance(x, sympy.Expr) and not isinstance(x, (sympy.Set,)):
        return 1
    return None


def _imaginary_unit(g: list, p: list) -> tuple[list, list]:
    """A gold with a free symbol ``i`` is complex: read ``i`` as the imaginary unit on both sides
    (latex2sympy keeps it a symbol, so ``14.0 + -1.0i`` != ``14 - i``: Math-Verify #69)."""
    import sympy  # in the worker (see _worker_loop)

    def named_i(x) -> list:  # latex2sympy gives the two sides symbols "i" with different assumptions
        return [s for s in x.free_symbols if s.name == "i"] if isinstance(x, sympy.Expr) else []

    if not any(named_i(x) for x in g):
        return g, p

    def sub(xs: list) -> list:
        return [x.subs({s: sympy.I for s in named_i(x)}) if named_i(x) else x for x in xs]

    return sub(g), sub(p)


def _complex_approx(gs, ps) -> bool:
    """A complex gold and a decimal complex answer equal to math-verify's own 6-place rounding, which
    its verify applies to real numbers only (``0.5 + 0.866025i`` for ``1/2 + sqrt(3)/2 i``)."""
    import sympy  # in the worker (see _worker_loop)

    gv, pv = _scalar_value(gs), _scalar_value(ps)
    if gv is None or pv is None or sympy.im(gv) == 0 or not ps.atoms(sympy.Float):
        return False
    return bool(abs(sympy.N(gv - pv, 30)) <= 5e-7 * max(1, abs(gv)))


def _mv_parse(text: str, parse, cfgs) -> list:  # pragma: no cover - in the worker
    """math-verify's parse; where it reads nothing, the same parse without its unit stripping.

    math-verify drops a trailing word it takes for a unit, single letters included ("c", "t", "s", "m"), so
    ``a + b + c`` reads as ``a +`` and ``\\sin^2 t`` as ``\\sin^2``, which parse to nothing: read again with
    ``NormalizationConfig(units=False)``. (Units the grader knows are dropped before: ``_prepare``.)
    """
    out = parse(text, extraction_config=cfgs[0], parsing_timeout=None)
    if len(cfgs) > 1 and not any(not isinstance(x, str) for x in out):
        again = parse(text, extraction_config=cfgs[1], parsing_timeout=None)
        if any(not isinstance(x, str) for x in again):
            return again
    return out


def _mv_check(gold: str, pred: str, parse, verify, cfg, gold_cache) -> dict:  # pragma: no cover
    """math-verify parse + verify with our guards; runs inside the worker. ``cfg``: the extraction configs
    (``_mv_parse``)."""
    g = gold_cache.get(gold)
    if g is None:
        g = _mv_parse(gold, parse, cfg)
        gold_cache[gold] = g
        if len(gold_cache) > 4096:
            gold_cache.popitem(last=False)
    p = _mv_parse(pred, parse, cfg)
    g, p = _imaginary_unit(g, p)
    # parse() appends the raw matched string as a last candidate (fallback_mode="first_match"),
    # which verify() may still match as a string; "parsed" means a sympy object came out.
    res = {
        "gold_parsed": any(not isinstance(x, str) for x in g),
        "pred_parsed": any(not isinstance(x, str) for x in p),
    }
    if not g or not p:
        res["ok"] = None
        return res
    ok = bool(verify(g, p, timeout_seconds=None, allow_set_relation_comp=True))
    if not ok:
        ok = _complex_approx(g[0], p[0])
    if ok:
        gs, ps = g[0], p[0]
        # Relative tolerance: math-verify compares numbers rounded to 6 decimal places, so any
        # two values below 5e-7 are "equal" (1/2004! == 1/2006!, math-verify #14).
        gv, pv = _scalar_value(gs), _scalar_value(ps)
        if gv is not None and pv is not None:
            import sympy  # in the worker (see _worker_loop)

            diff = abs(sympy.N(gv - pv, 30))
            scale = max(abs(gv), abs(pv))
            if scale != 0 and diff > REL_TOL * scale:
                ok = False
                res["veto"] = "relative tolerance"
        # Exact set semantics: a proper subset of a "find all" answer is wrong (math-verify alone accepts one; see the
        # docstring).
        gn, pn = _set_size(gs), _set_size(ps)
        if ok and gn is not None and pn is not None and gn != pn and (gn > 1 or pn > 1):
            ok = False
            res["veto"] = "set size"
    res["ok"] = ok
    return res


def _sympy_check(gold: str, pred: str, read, LatexError, gold_cache) -> dict:  # pragma: no cover - in the worker
    """The grader's own reader + sympy (``latex.equivalent``); same reply shape as ``_mv_check``."""
    from .latex import equivalent  # sympy: in the worker

    res: dict = {"by": "sympy"}
    g = gold_cache.get(gold)
    if g is None:
        try:
            g = read(gold)
        except (LatexError, RecursionError):
            g = False
        gold_cache[gold] = g
        if len(gold_cache) > 4096:
            gold_cache.popitem(last=False)
    try:
        p = read(pred)
    except (LatexError, RecursionError):
        p = False
    res["gold_parsed"], res["pred_parsed"] = g is not False, p is not False
    res["ok"] = None if g is False or p is False else bool(equivalent(g, p))
    return res


class _Worker:
    def __init__(self, backend_name: str) -> None:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        # A fresh interpreter (not fork): safe when the parent has threads, and no re-import of
        # the caller's __main__ as multiprocessing's spawn would do.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from data_tools.grader.sandbox import _worker_loop; _worker_loop({backend_name!r})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        msg = self._read(WORKER_START_TIMEOUT_S)
        if not msg or not msg.get("ready"):
            self.kill()
            raise RuntimeError("grader worker failed to start (is sympy installed?)")
        self.backend = msg.get("backend", backend_name)
        if self.backend != backend_name:
            _fall_back(msg.get("why", "the worker could not import it"))

    def _read(self, timeout: float) -> dict | None:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not r:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("grader worker died")
        return json.loads(line)

    def call(self, req: dict, timeout: float) -> dict | None:
        """The worker's answer, or None on timeout (the worker is then dead)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        res = self._read(timeout)
        if res is None:
            self.kill()
        return res

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f:
                    f.close()
            except Exception:  # noqa: BLE001
                pass


class _Pool:
    """Idle workers shared by all threads; each call takes one exclusively."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def call(self, req: dict, timeout: float) -> dict | None:
        name = backend()
        with self._lock:
            w = self._idle.pop() if self._idle else None
        if w is not None and w.backend != name:
            w.kill()
            w = None
        if w is None or not w.alive():
            w = _Worker(name)
        try:
            res = w.call(req, timeout)
        except (EOFError, OSError, ValueError):
            w.kill()
            return {"error": "worker died"}
        if res is None:
            return None
        with self._lock:
            if len(self._idle) < max(2, (os.cpu_count() or 2) * 2):
                self._idle.append(w)
                w = None
        if w is not None:
            w.kill()
        return res

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_POOL = _Pool()
atexit.register(_POOL.close)
_CACHE: OrderedDict[tuple[str, str, str], dict] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def _math_verify(gold_latex: str, pred_latex: str, timeout_s: float) -> dict | None:
    """Cached worker call: {'ok': bool|None, ...}, or None on timeout. Timeouts are not cached."""
    key = (_BACKEND or backend(), gold_latex, pred_latex)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    res = _POOL.call({"gold": gold_latex, "pred": pred_latex}, timeout_s)
    if res is not None and "error" not in res:
        with _CACHE_LOCK:
            _CACHE[key] = res
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return res

