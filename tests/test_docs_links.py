"""Relative links in README.md and bench/**/*.md, and configs' ``bench/*.md#anchor`` references, resolve.

A link is ``[text](target)`` or ``![alt](target)`` outside fenced code blocks; web links are not followed. A target
``file.md#anchor`` (or ``#anchor`` in the same file) needs a heading whose GitHub anchor is ``anchor``.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
CONFIG_REF = re.compile(r"\b(bench/[\w./-]+\.md)(#[\w-]+)?")


def _prose(text: str) -> list[str]:
    """The lines of a markdown file outside ``` fences."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "bench").rglob("*.md"))]


def _broken(src: Path, target: str) -> str | None:
    """Why ``target`` (as written in ``src``) does not resolve, or None."""
    path, _, frag = target.partition("#")
    dest = (src.parent / path).resolve() if path else src
    if not dest.exists():
        return f"{target}: no such file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}"
    if frag and dest.suffix == ".md" and frag not in anchors(dest):
        return f"{target}: no heading with anchor #{frag} in {dest.relative_to(REPO)}"
    return None


def test_anchor_matches_github():
    assert anchor("The verdict so far, and the defaults") == "the-verdict-so-far-and-the-defaults"
    assert anchor("Run 2 — the combined recipe (`OPDTrainer`, `trainers/offpolicy.py`)") == \
        "run-2--the-combined-recipe-opdtrainer-trainersoffpolicypy"
    assert anchor("Index of runs") == "index-of-runs"
    assert anchor("Run 9 — `decode_kv_growth` in the realistic step") == "run-9--decode_kv_growth-in-the-realistic-step"


def test_link_pattern_finds_links_and_images():
    line = "see [the log](learning/a.md#x), ![plot](p.png) and [web](https://example.org) [[1]](b.md)"
    assert LINK.findall(line) == ["learning/a.md#x", "p.png", "https://example.org", "b.md"]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    bad = []
    for i, line in enumerate(_prose(doc.read_text()), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            why = _broken(doc, target)
            if why:
                bad.append(why)
    assert not bad, f"{doc.relative_to(REPO)}: " + "; ".join(bad)


def test_bench_docs_are_linked_from_their_index():
    """Every log under bench/learning/ and bench/results/ is reachable from LEARNING.md or RESULTS.md."""
    for index, folder in (("LEARNING.md", "learning"), ("RESULTS.md", "results")):
        text = (REPO / "bench" / index).read_text()
        linked = {t.partition("#")[0] for t in LINK.findall(text)}
        logs = {f"{folder}/{p.name}" for p in (REPO / "bench" / folder).glob("*.md")}
        assert logs, folder
        assert not logs - linked, f"bench/{index} does not link {sorted(logs - linked)}"


def test_config_references_to_bench_docs_resolve():
    bad = []
    for cfg in sorted((REPO / "configs").rglob("*.yaml")):
        for path, frag in CONFIG_REF.findall(cfg.read_text()):
            why = _broken(REPO / "x", path + frag)
            if why:
                bad.append(f"{cfg.relative_to(REPO)}: {why}")
    assert not bad, "; ".join(bad)
