"""The rehearsal's verified share: stage one counts a stated, deterministic fraction of samples as verified.

A rehearsal (``run.sh --rehearse``) runs the formal recipe on random-weight models of the formal shapes
(``data_tools.formal_models``). Their completions never verify, so without help the band filter would keep no
problem, the curriculum would hold no teacher solution and the SFT phase would have nothing to train on. With the
environment variable ``OPD_REHEARSAL_VERIFIED`` set, stage one's grading (``stages.curate_sampling.sample_call``) also
counts as correct every sample whose key falls under its role's fraction:

    u = first 8 bytes of sha256("<problem_id>\\0<role>\\0<sample_index>") / 2**64;  verified if u < fraction[role]

(keyed by the sample, not by the order or the process that graded it: a resumed or sharded stage one counts the same
samples). Those rows carry ``grader_path = "rehearsal"``; a sample the grader verified stays verified.

``OPD_REHEARSAL_VERIFIED`` is ``T`` (the teacher's fraction; the student gets ``T / 2``) or ``T,S``, each in
[0, 1], T > 0. The teacher and the student get different fractions so that the student's pass rate over its
``student_samples`` lands inside the band (0 < p < 1) for most problems: with 8 student samples at S = 0.25, 90%
of them; 4 teacher samples at T = 0.5 solve 94% of the problems.

Never reachable from a real run's configuration: only that environment variable turns it on (``run.sh --rehearse``
sets it), a config file naming it is refused (``refuse_in_config``, called by ``data_tools.config``), and a stage
one that uses it says so on stdout and records it in its manifest (``manifest_record``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

ENV = "OPD_REHEARSAL_VERIFIED"
#: config keys refused with an explanation (compared lower-case): the switch is the environment variable alone
CONFIG_KEYS = frozenset({"opd_rehearsal_verified", "rehearsal_verified", "rehearsal_verified_fraction",
                         "verified_fraction", "rehearsal_verified_share"})
GRADER_PATH = "rehearsal"


@dataclass(frozen=True)
class VerifiedShare:
    """Fractions of samples stage one counts as verified, per role (see the module docstring)."""

    teacher: float
    student: float
    raw: str = ""

    def fraction(self, role: str) -> float:
        if role not in ("teacher", "student"):
            raise ValueError(f"role must be teacher or student, got {role!r}")
        return self.teacher if role == "teacher" else self.student

    def counts(self, problem_id: str, role: str, sample_index: int) -> bool:
        """True if this sample is counted as verified (deterministic in its three keys)."""
        return unit_hash(problem_id, role, sample_index) < self.fraction(role)

    def record(self) -> dict:
        """The manifest's ``rehearsal`` block."""
        return {"env": ENV, "value": self.raw, "teacher_fraction": self.teacher, "student_fraction": self.student,
                "rule": "verified if sha256(problem_id, role, sample_index) / 2**64 < the role's fraction",
                "grader_path": GRADER_PATH}

    def line(self) -> str:
        return (f"[rehearsal] {ENV}={self.raw}: stage one counts {self.teacher:.3g} of teacher and {self.student:.3g} "
                f"of student samples as verified (grader_path '{GRADER_PATH}'); a rehearsal only, never a real run")


def unit_hash(problem_id: str, role: str, sample_index: int) -> float:
    """A number in [0, 1) from the sample's keys (sha256, first 8 bytes)."""
    digest = hashlib.sha256(f"{problem_id}\0{role}\0{int(sample_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def parse(value: str) -> VerifiedShare:
    """``"T"`` or ``"T,S"`` -> ``VerifiedShare``. Raises ``ValueError`` naming ``OPD_REHEARSAL_VERIFIED``."""
    parts = [p.strip() for p in str(value).split(",")]
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (1, 2) or len(nums) != len(parts):
        raise ValueError(f"{ENV}={value!r}: expected a fraction T (teacher; the student gets T/2) or T,S")
    t, s = nums[0], (nums[1] if len(nums) == 2 else nums[0] / 2)
    if not (0.0 < t <= 1.0 and 0.0 <= s <= 1.0):
        raise ValueError(f"{ENV}={value!r}: the teacher's fraction must lie in (0, 1] and the student's in [0, 1]")
    return VerifiedShare(teacher=t, student=s, raw=str(value))


def from_env(env: Mapping[str, str] | None = None) -> VerifiedShare | None:
    """The share ``OPD_REHEARSAL_VERIFIED`` sets, or None when it is unset or empty (every real run)."""
    value = (os.environ if env is None else env).get(ENV, "")
    return parse(value) if value.strip() else None


_announced: set[str] = set()


def count_verified(verdicts: Sequence, keys: Iterable[tuple[str, str, int]], env: Mapping[str, str] | None = None) -> list:
    """``verdicts`` (``data_tools.grader.Verdict``) with the rehearsal's share counted as verified.

    ``keys``: ``(problem_id, role, sample_index)`` per verdict. Without ``OPD_REHEARSAL_VERIFIED`` the verdicts come
    back unchanged. The first use in a process prints ``VerifiedShare.line``.
    """
    share = from_env(env)
    if share is None:
        return list(verdicts)
    if share.raw not in _announced:
        _announced.add(share.raw)
        print(share.line(), flush=True)
    out = []
    for v, (pid, role, i) in zip(verdicts, keys, strict=True):
        out.append(v if v.correct or not share.counts(pid, role, i) else replace(v, correct=True, path=GRADER_PATH))
    return out


def manifest_record(env: Mapping[str, str] | None = None) -> dict | None:
    """The manifest's ``rehearsal`` entry: the share's settings, or None for a real run."""
    share = from_env(env)
    return None if share is None else share.record()


def refuse_in_config(cfg: Mapping, path: str) -> None:
    """Raise ``ValueError`` if the config mapping ``cfg`` (file ``path``) names the rehearsal switch."""
    bad = sorted(k for k in cfg if str(k).lower() in CONFIG_KEYS)
    if bad:
        raise ValueError(f"config file {path}: {bad} is the rehearsal-only verified share; only `run.sh --rehearse` "
                         f"sets it, through the environment variable {ENV}, never a config file")


__all__ = ["ENV", "VerifiedShare", "count_verified", "from_env", "manifest_record", "parse", "refuse_in_config",
           "unit_hash"]
