"""Loading math problems: jsonl, parquet, a ``datasets`` directory, or the synthetic generator.

Accepts the usual column names (docs/design.md section 3) and reports which ones it used. Every row
that cannot be used goes to ``rejects`` with its reason, never silently dropped: no problem text,
no answer, an answer the grader cannot parse, or a duplicate of an earlier problem.

verl's RL format (``prompt`` a list of chat messages, ``reward_model`` a struct with ``ground_truth``; the formal
run's ``TRAIN_DATA``) is read too: the problem is the one user message, with DAPO-Math's instruction wrapper
recognised and removed (``DAPO_PREFIX`` ... ``DAPO_SUFFIX``, any whitespace between words), since our own prompt
style adds the instruction; a message in any other wrapper is kept verbatim and counted in the load summary.
The answer is ``reward_model.ground_truth``, the id ``extra_info.index`` where the row has one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from data_tools.grader import extract_gsm8k_answer, parse_gold
from data_tools.synth import generate

#: Accepted column names per role, in order of preference.
PROBLEM_COLUMNS = ("problem", "question", "prompt", "query", "input")
ANSWER_COLUMNS = ("answer", "final_answer", "gold", "target", "expected_answer")
SOLUTION_COLUMNS = ("solution", "reference_solution", "rationale")
ID_COLUMNS = ("problem_id", "unique_id", "id", "idx")
SOURCE_COLUMNS = ("source", "data_source", "subject", "type")
LEVEL_COLUMNS = ("level", "difficulty")

#: DAPO-Math-17k's user message: this prefix, the problem, this suffix (verl's DAPO recipe data).
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
_DAPO_RE = re.compile(r"\s*" + r"\s+".join(map(re.escape, DAPO_PREFIX.split())) + r"\s+(?P<problem>.*?)\s+"
                      + r"\s+".join(map(re.escape, DAPO_SUFFIX.split())) + r"\s*", re.S)

_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)
_CALC = re.compile(r"<<[^>]*>>")  # GSM8K calculator annotations: "<<48/2=24>>"


@dataclass
class LoadResult:
    """Problems read from one source.

    ``rows``: dicts with problem_id, problem, answer, solution (str|None), source, level (str|None).
    ``rejects``: dicts with row_index, problem_id, reason, raw (the row as JSON, for the record).
    ``columns``: role -> column name used (e.g. ``{"problem": "question", "answer": "answer (#### N)"}``).
    ``duplicates``: rows that repeat an earlier problem text with the same answer (rejected as duplicates).
    ``conflicts``: rows that repeat an earlier problem text with a different answer (rejected as conflicts).
    A row whose id an earlier, different problem holds is kept under ``<id>@row<i>`` (``reused_ids``).
    Each repeated row is counted once, in one of the two: ``duplicates + conflicts`` rows repeated a problem.
    """

    source: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    columns: dict[str, str] = field(default_factory=dict)
    duplicates: int = 0
    conflicts: int = 0
    #: rows whose id was already another problem's: kept under ``<id>@row<i>`` (the first few such ids)
    reused_ids: int = 0
    reused_id_rows: list[str] = field(default_factory=list)
    n_read: int = 0
    #: verl format only: rows whose DAPO wrapper was removed; rows whose user message was in no wrapper we
    #: recognise (kept verbatim), and the first few of those row indices.
    unwrapped: int = 0
    wrapper_unrecognised: int = 0
    unrecognised_rows: list[int] = field(default_factory=list)
    #: verl format only: messages of other roles than the one user message (system, assistant), dropped, by role
    other_roles: dict[str, int] = field(default_factory=dict)

    def report(self) -> str:
        """One line for the log: counts and the columns used (for verl data the problem column names the wrappers
        found, and the line the first rows whose wrapper was not recognised)."""
        cols = ", ".join(f"{k}<-{v}" for k, v in self.columns.items())
        line = (f"{self.source}: read {self.n_read} rows, kept {len(self.rows)}, rejected {len(self.rejects)} "
                f"({self.duplicates} duplicates, {self.conflicts} duplicates with a conflicting answer); columns: {cols}")
        if self.reused_ids:
            more = ", ..." if self.reused_ids > len(self.reused_id_rows) else ""
            line += (f"; {self.reused_ids} rows reused the id of another problem (column {self.columns.get('id')!r}), "
                     f"kept under ids of their own: {', '.join(self.reused_id_rows)}{more}")
        if self.wrapper_unrecognised:
            more = ", ..." if self.wrapper_unrecognised > len(self.unrecognised_rows) else ""
            line += f"; wrapper not recognised in rows {', '.join(map(str, self.unrecognised_rows))}{more}"
        if self.other_roles:
            line += "; messages dropped (only the user message is the problem): " + ", ".join(
                f"{n} {r}" for r, n in sorted(self.other_roles.items()))
        return line


#: the files ``datasets.save_to_disk`` writes: a directory with one of them is a saved dataset, else a folder of shards
_SAVED_DATASET = ("dataset_info.json", "state.json", "dataset_dict.json")
_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")


def data_shards(path: Path, split: str = "train") -> list[Path]:
    """The data files of a folder of shards (a hub download: ``data/train-00000-of-00002.parquet``, ...): its
    ``.parquet`` and ``.jsonl`` files at any depth, in name order; where the names (or folders) carry splits, those of
    ``split`` only (never test problems in the training data). Empty for a file or a saved ``datasets`` directory;
    a folder with no such file (of ``split``) is an error."""
    if not path.is_dir() or any((path / m).exists() for m in _SAVED_DATASET):
        return []
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (".parquet", ".jsonl"))

    def split_of(p: Path) -> str | None:  # a whole word of the name or of a folder under ``path``: math_test.jsonl
        words = set(re.split(r"[-_.\s]+", p.stem.lower())) | {x.lower() for x in p.relative_to(path).parts[:-1]}
        return next((s for s in _SPLITS if s in words), None)

    named = [split_of(p) for p in files]
    if any(named) and not all(named):
        some, others = ([p.name for p, s in zip(files, named) if bool(s) == want] for want in (True, False))
        raise ValueError(f"{path}: some files name a split ({', '.join(some)}) and others do not ({', '.join(others)}): "
                         "which are training data is unclear; point at one file, or a folder of one split")
    shards = [p for p, s in zip(files, named) if s == split] if any(named) else files
    if not shards:
        raise ValueError(f"{path}: a directory with no .parquet or .jsonl file (of the {split} split, where names "
                         f"carry splits), and not a saved datasets directory (no {' / '.join(_SAVED_DATASET)})")
    return shards


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        from datasets import load_from_disk  # heavy (seconds), for a datasets directory only

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):  # a DatasetDict: take "train" or the only split
            splits = list(ds.keys())
            ds = ds["train"] if "train" in ds else ds[splits[0]]
        return [dict(r) for r in ds]
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, "rb") as f:
            data = f.read()
        if suffix == ".json" and data.lstrip()[:1] == b"[":  # one JSON array of objects
            try:
                items = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: not a valid JSON array: {e}") from None
            return [rec if isinstance(rec, dict) else {"__error__": f"item {i} is not a JSON object",
                                                       "__raw__": str(rec)[:500]} for i, rec in enumerate(items)]
        records = []
        for i, raw in enumerate(data.splitlines(), 1):
            if not raw.strip():
                continue
            try:  # decoded per line, so one bad byte rejects its line, not the file
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                records.append({"__error__": f"line {i} is not UTF-8 ({e.reason} at byte {e.start})",
                                "__raw__": raw[:500].decode("utf-8", "replace")})
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                records.append({"__error__": f"line {i} is not valid JSON: {e.msg}", "__raw__": line[:500]})
                continue
            records.append(rec if isinstance(rec, dict) else {"__error__": f"line {i} is not a JSON object"})
        return records
    if suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: {UNSUPPORTED}")


def unwrap_dapo(text: str) -> str | None:
    """The problem inside DAPO-Math's user-message wrapper, or None when ``text`` is not in that wrapper."""
    m = _DAPO_RE.fullmatch(text)
    return m.group("problem").strip() if m else None


#: Where each role's value comes from in a verl row (named in the load summary and in every reject reason).
VERL_FIELDS = {"problem": "prompt (the user message)", "answer": "reward_model.ground_truth", "id": "extra_info.index",
               "source": "data_source"}


def _is_verl(columns: set[str]) -> bool:
    # prompt + reward_model is verl whatever else a row carries: a stray "answer" column must not turn the chat
    # messages into a problem's text (the answer comes from reward_model.ground_truth)
    return "reward_model" in columns and "prompt" in columns


def _verl_user_text(prompt: Any) -> str:
    """The one user message of a verl ``prompt`` (a plain string is taken as it is).

    Raises:
        ValueError: the reason, naming the field.
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"field 'prompt' must be a list of {{role, content}} messages, got {type(prompt).__name__}")
    users = []
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"field 'prompt': message {j} is not a {{role, content}} struct")
        if msg["role"] == "user":
            users.append(msg.get("content"))
    if len(users) != 1:
        roles = [m["role"] for m in prompt]
        raise ValueError(f"field 'prompt': expected one message with role 'user', found {len(users)} (roles {roles})")
    if not isinstance(users[0], str):
        raise ValueError(f"field 'prompt': the user message's content is {type(users[0]).__name__}, not text")
    return users[0]


def _from_verl(records: list[dict[str, Any]], res: LoadResult) -> tuple[list[dict[str, Any]], str]:
    """verl rows as flat records (problem, answer, problem_id, data_source), and where their ids came from; a row
    that cannot be read becomes an error record whose reason names the field."""
    out: list[dict[str, Any]] = []
    id_fallbacks: set[str] = set()
    for i, rec in enumerate(records):
        if "__error__" in rec:
            out.append(rec)
            continue
        flat: dict[str, Any] = {"data_source": rec.get("data_source")}
        extra = rec.get("extra_info")
        if isinstance(extra, dict) and extra.get("index") is not None:
            flat["problem_id"] = extra["index"]
        elif (ic := next((c for c in ID_COLUMNS if rec.get(c) is not None), None)) is not None:
            flat["problem_id"] = rec[ic]  # the usual id rule
            id_fallbacks.add(ic)
        try:
            text = _verl_user_text(rec.get("prompt"))
            for m in rec.get("prompt") if isinstance(rec.get("prompt"), (list, tuple)) else ():
                if m.get("role") != "user":
                    res.other_roles[m["role"]] = res.other_roles.get(m["role"], 0) + 1
            rm = rec.get("reward_model")
            if not isinstance(rm, dict):
                raise ValueError(f"field 'reward_model' must be a struct with ground_truth, got {type(rm).__name__}")
            gt = rm.get("ground_truth")
            if isinstance(gt, bool) or (gt is not None and not isinstance(gt, (str, int))):
                raise ValueError(f"field 'reward_model.ground_truth' must be text or an integer, got {type(gt).__name__}")
        except ValueError as e:
            out.append({**flat, "__error__": str(e), "__row__": rec})
            continue
        problem = unwrap_dapo(text)
        if problem is not None:
            res.unwrapped += 1
        elif text.strip():
            problem = text.strip()  # another wrapper, or none: kept as written and counted
            res.wrapper_unrecognised += 1
            if len(res.unrecognised_rows) < 5:
                res.unrecognised_rows.append(i)
        flat.update(problem=problem, answer=gt)
        out.append(flat)
    return out, ", else ".join([VERL_FIELDS["id"], *sorted(id_fallbacks)])


def _pick(columns: set[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in columns), None)


#: The files ``load_problems`` reads (besides a ``datasets`` directory and ``synth:``).
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
UNSUPPORTED = "unsupported data file (use .jsonl, .parquet, a folder of them or a datasets directory)"


def _json_fields(rec: dict[str, Any]) -> dict[str, set[str] | None]:
    return {k: set(v) if isinstance(v, dict) else None for k, v in rec.items()}


def _arrow_fields(schema) -> dict[str, set[str] | None]:
    import pyarrow as pa

    return {f.name: {c.name for c in f.type} if pa.types.is_struct(f.type) else None for f in schema}


def _features_fields(features: dict[str, Any]) -> dict[str, set[str] | None]:
    """A ``datasets`` directory's features (``dataset_info.json``): a struct is a dict of its fields, a leaf has
    ``_type``."""
    return {k: set(v) if isinstance(v, dict) and "_type" not in v else None for k, v in features.items()}


def read_header(path: Path, split: str = "train") -> dict[str, set[str] | None] | None:
    """The fields of a data file's rows, read without its rows (the preflight's check, in well under a second):
    a parquet file's schema, the first JSON object of a ``.jsonl`` / ``.json`` file, a ``datasets`` directory's
    features. Each field maps to its sub-fields when it is a struct (verl's ``reward_model``), else None. None when
    the header cannot tell (a ``datasets`` directory without ``dataset_info.json``, an empty file).

    Raises:
        ValueError: an unsupported file type, or a JSON file whose first lines are not JSON objects.
    """
    if shards := data_shards(path, split):  # a folder of shards: its first file's header
        return read_header(shards[0])
    if path.is_dir():
        d = path
        if (path / "dataset_dict.json").is_file():  # a DatasetDict: "train" or the only split, as the loader takes
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
            d = path / ("train" if "train" in splits else (splits or [""])[0])
        info = d / "dataset_info.json"
        if not info.is_file():
            return None
        return _features_fields(json.loads(info.read_text()).get("features") or {})
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _arrow_fields(pq.read_schema(path))
    if suffix not in DATA_SUFFIXES:
        raise ValueError(f"{path}: {UNSUPPORTED}")
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    text = head.decode("utf-8", "replace")
    if suffix == ".json" and text.lstrip()[:1] == "[":  # one JSON array of objects: its first object
        body = text.lstrip()[1:].lstrip()
        try:
            rec = json.JSONDecoder().raw_decode(body)[0] if body and body[0] != "]" else None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a valid JSON array ({e.msg} in its first item)") from None
        return _json_fields(rec) if isinstance(rec, dict) else None
    lines = [x for x in text.splitlines()[:20] if x.strip()]
    for line in lines:  # the first line that is a JSON object (the loader rejects a bad line alone)
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            return _json_fields(rec)
    if lines:
        raise ValueError(f"{path}: none of its first {len(lines)} lines is a JSON object (JSON lines: one object a line)")
    return None


def header_refusal(path: Path, split: str = "train") -> str | None:
    """Why the rows of ``path`` cannot be read as problems, from its header alone (:func:`read_header`; ``split``: a
    folder's split, as the loader reads it): the file named, then the missing field and the accepted shapes; None when
    the header is usable. Rows may still be rejected one by one when the run loads them."""
    try:
        fields = read_header(path, split)
    except (ValueError, OSError) as e:
        return str(e) if str(e).startswith(str(path)) else f"{path}: {e}"
    if fields is None:
        return None
    cols = set(fields)
    found = f"found columns {sorted(cols)}"
    if _is_verl(cols):
        sub = fields["reward_model"]
        if sub is None or "ground_truth" not in sub:
            have = f"its fields: {sorted(sub)}" if sub is not None else "it is not a struct"
            return (f"{path}: verl rows (prompt + reward_model) need the field 'reward_model.ground_truth' ({have}); "
                    f"{found}")
        return None
    if _pick(cols, PROBLEM_COLUMNS) is None:
        return (f"{path}: no problem column (one of {', '.join(PROBLEM_COLUMNS)}), nor verl's prompt + "
                f"reward_model.ground_truth; {found}")
    if _pick(cols, ANSWER_COLUMNS) is None:
        return (f"{path}: no answer column (one of {', '.join(ANSWER_COLUMNS)}), nor verl's "
                f"reward_model.ground_truth; {found}")
    return None


def _text(v: Any) -> str:
    return "" if v is None else str(v).strip()


def load_problems(source: str | Path, *, limit: int | None = None, seed: int = 0, split: str = "train") -> LoadResult:
    """Read problems from ``source``: a file / ``datasets`` dir, or ``synth:<split>:<n>`` (e.g. ``synth:train:200``;
    ``synth-hard:<split>:<n>`` for the hard ladder, ``data_tools.synth``).

    ``limit`` keeps the first N input rows (before rejects). Answers are validated with the grader's
    :func:`data_tools.grader.parse_gold`; GSM8K answers (rationale then ``#### N``) are split into
    the number (answer) and the rationale without calculator annotations (solution).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unsupported file type, an empty file, or no problem / answer column (the message
            lists the columns found and the names accepted).
    """
    src = str(source)
    if src.startswith(("synth:", "synth-hard:")):
        parts = src.split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"synthetic source must look like {parts[0]}:<train|test>:<n>, got {src!r}")
        n = int(parts[2]) if limit is None else min(int(parts[2]), limit)
        rows = generate(parts[1], n, seed=seed, ladder="hard" if parts[0] == "synth-hard" else "easy")
        return LoadResult(src, rows=rows, n_read=len(rows),
                          columns={"problem": "synth", "answer": "synth", "solution": "synth"})

    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data source {src} does not exist")
    if shards := data_shards(path, split):  # a folder of files: read in name order, named in the load line
        records = [rec for f in shards for rec in _read_records(f)]
        names = ", ".join(str(f.relative_to(path)) for f in shards[:3]) + (", ..." if len(shards) > 3 else "")
        src = f"{src} ({len(shards)} file(s): {names})"
    else:
        records = _read_records(path)
    if not records:
        raise ValueError(f"{src}: no rows (the file is empty)")
    if limit is not None:
        records = records[:limit]
    res = LoadResult(src, n_read=len(records))
    cols = set().union(*(r.keys() for r in records)) - {"__error__", "__raw__"}
    labels: dict[str, str] = {}  # column -> the name reject reasons and the summary give it
    if _is_verl(cols):
        records, id_label = _from_verl(records, res)
        cols = {k for r in records for k in r if not k.startswith("__")}
        labels = {"problem": VERL_FIELDS["problem"], "answer": VERL_FIELDS["answer"], "problem_id": id_label,
                  "data_source": VERL_FIELDS["source"]}
    pc, ac = _pick(cols, PROBLEM_COLUMNS), _pick(cols, ANSWER_COLUMNS)
    if (pc is None or ac is None) and any("__error__" not in r for r in records):
        raise ValueError(f"{src}: need a problem column (one of {PROBLEM_COLUMNS}) and an answer column "
                         f"(one of {ANSWER_COLUMNS}); found columns {sorted(cols)}")
    sc, ic = _pick(cols, SOLUTION_COLUMNS), _pick(cols, ID_COLUMNS)
    src_c, lc = _pick(cols, SOURCE_COLUMNS), _pick(cols, LEVEL_COLUMNS)
    res.columns = {k: labels.get(v, v) for k, v in dict(problem=pc, answer=ac, solution=sc, id=ic, source=src_c, level=lc).items() if v}
    pname, aname = labels.get(pc, pc), labels.get(ac, ac)
    stem = path.stem if path.is_file() else path.name
    seen: dict[str, tuple[str, str]] = {}  # normalised problem text -> (problem_id, answer)
    ids: set[str] = set()
    gsm8k_rows = 0
    for i, rec in enumerate(records):
        pid = _text(rec.get(ic)) if ic else ""
        pid = pid or f"{stem}-{i}"

        def reject(reason: str) -> None:
            reason = f"row {i}: {reason}" if labels else reason  # verl rows: the row and the field in every reason
            res.rejects.append({"row_index": i, "problem_id": pid, "reason": reason,
                                "raw": json.dumps(rec, default=str)[:2000]})

        if "__error__" in rec:
            reject(rec["__error__"])
            continue
        problem, answer_raw = _text(rec.get(pc)), _text(rec.get(ac))
        solution = _text(rec.get(sc)) if sc else ""
        if not problem:
            reject(f"empty problem (column {pname!r})")
            continue
        if not answer_raw:
            reject(f"no answer (column {aname!r})")
            continue
        answer = answer_raw
        if "####" in answer_raw:  # GSM8K: rationale, then "#### N"
            gsm8k_rows += 1
            answer = extract_gsm8k_answer(answer_raw) or ""
            solution = solution or _CALC.sub("", _GSM8K.sub("", answer_raw)).strip()
            if not answer:
                reject(f"GSM8K answer without a number after ####: {answer_raw[-80:]!r}")
                continue
        gold = parse_gold(answer)
        if gold is None:
            reject(f"answer does not parse (column {aname!r}): {answer[:200]!r}")
            continue
        key = " ".join(problem.split()).lower()
        if key in seen:  # counted once: a conflict (another answer) or a duplicate (the same answer)
            first_id, first_answer = seen[key]
            if first_answer != gold:
                res.conflicts += 1
                reject(f"conflict: duplicate problem with a different answer ({gold!r} here, {first_answer!r} in {first_id})")
            else:
                res.duplicates += 1
                reject(f"duplicate problem (first seen as {first_id})")
            continue
        if pid in ids:  # another problem under a used id: kept under an id of its own, never dropped
            base, k = f"{pid}@row{i}", 1
            pid = base
            while pid in ids:
                pid, k = f"{base}.{k}", k + 1
            res.reused_ids += 1
            if len(res.reused_id_rows) < 3:
                res.reused_id_rows.append(pid)
        seen[key] = (pid, gold)
        ids.add(pid)
        res.rows.append({"problem_id": pid, "problem": problem, "answer": gold, "solution": solution or None,
                         "source": _text(rec.get(src_c)) or None if src_c else None,
                         "level": _text(rec.get(lc)) or None if lc else None})
    if gsm8k_rows:
        res.columns["answer"] = f"{ac} (GSM8K '#### N' in {gsm8k_rows} rows)"
    if labels and pc:  # the counts travel with the columns into stage one's manifest
        res.columns["problem"] = (f"{labels[pc]}: DAPO's wrapper removed in {res.unwrapped} rows, not recognised in "
                                  f"{res.wrapper_unrecognised} rows (kept verbatim)")
    return res
