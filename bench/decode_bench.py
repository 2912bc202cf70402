"""Decode micro-bench: one realistic stage-two generation call, decoder levers on and off.

The formal recipe's batch: 32 prompts x G = 4 = 128 completions, a cap of 8,192 new tokens, sampled at
T = 1. Completion lengths per row follow a log-normal (median 1,500 tokens; sigma set so that 6% of rows
reach the cap, near the 6.45% of MATH-500 samples seed 000's recipe clipped at 12,288 tokens; the median is
the brief's), clipped to [1, cap], taken as the law's 128 quantiles in random order (``draw_lengths``), and forced with ``FastGenerator.generate(forced_lengths=...)``
(EOS as the drawn token, none before) so every mode decodes the same lengths from a random-weight
Qwen2.5-1.5B-shaped bf16 model. Prompts: random ids, 128..512 tokens per prompt.

Modes (``data_tools.generation.fast_decoder.FastGenerator``, ``check_every`` = 128 as the trainer's):
  base        static batch to the longest member (CUDA graph, full static cache length)
  compaction  ``compaction=True``: length-bucketed attention + batch compaction
  compile     ``compile_step=True``: compiled decoder layers inside the graph
  both        both
  compaction+grow, both+grow   the same with ``kv_growth=True``: the KV cache sized to the window (grown with
              the length bucket, shrunk at each compaction) instead of B x L; its peak is max over windows
              (b x cap) x KV bytes per token (``data_tools.generation.kv_cache``), printed as ``kv_expected_gb``
Compile modes first run an untimed warm-up call whose rows finish so that every batch bucket is met (the
compiles are once per process; its time is ``warmup_s``). Graph captures are in the timed call, as in
training (``keep_cache=False`` re-captures every call).

Memory per mode: ``peak_rise_gb`` / ``reserved_rise_gb`` (CUDA allocator, the call's peak above what was
allocated / reserved before it), ``kv_peak_gb`` (``DecodeKV.peak_bytes``: the cache's own high-water mark, a
reallocation's transient included), ``kv_expected_gb`` (``kv_cache.window_path`` on the drawn lengths: the
cache's steady peak), ``kv_full_gb`` (B x L, the cache without growth), ``kv_reallocations``.

Floor: per decode step, the weights plus the live rows' KV (each row's own prompt + tokens so far) read once
at the measured device-to-device copy bandwidth, summed over the steps to the longest row.

usage:  python bench/decode_bench.py [--modes base,compaction,both,compile] [--out decode_bench.json]
        python bench/decode_bench.py --modes compaction,compaction+grow      (the KV growth lever: time, memory)
        python bench/decode_bench.py --device cpu --tiny      (CPU smoke test of the same code)
Writes JSON (to --out, default $OUT/decode_bench.json, or decode_bench.json in the system temp folder) and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from opd_step_bench import QWEN15, TINY  # noqa: E402

#: mode -> (compaction, compile_step, kv_growth)
MODES = {"base": (False, False, False), "compaction": (True, False, False), "compile": (False, True, False),
         "both": (True, True, False), "compaction+grow": (True, False, True), "both+grow": (True, True, True)}
EOS, PAD = 0, 0


def draw_lengths(n: int, median: float, cap: int, cap_share: float, seed: int) -> list[int]:
    """Log-normal lengths ``exp(ln median + sigma z)``, ``sigma = ln(cap/median) / z(1 - cap_share)``, in [1, cap].

    Stratified: the ``n`` quantiles ``(i + 0.5) / n`` of that law in a seeded random order, so a batch of 128
    has the stated median and share at the cap (8 rows, 6.25%) without a draw's noise (a plain draw of 128
    has a standard deviation of 2.7 rows at the cap; one seed gave 4).
    """
    nd = statistics.NormalDist()
    sigma = math.log(cap / median) / nd.inv_cdf(1.0 - cap_share)
    xs = [math.exp(math.log(median) + sigma * nd.inv_cdf((i + 0.5) / n)) for i in range(n)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [int(min(cap, max(1, round(xs[i])))) for i in order]


def copy_bandwidth(device) -> float:
    """Device memory bandwidth in bytes/s: a 1 GiB device-to-device copy (read + write), best of 5."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2 * (1 << 30) / best


def floor_bytes(plens: list[int], lengths: list[int], weight_bytes: int, kv_token_bytes: int) -> tuple[int, int]:
    """(decode steps, bytes read): step t (1..max-1) reads the weights + each live row's ``p_i + t`` KV tokens."""
    steps = max(lengths) - 1
    total = 0
    for t in range(1, steps + 1):
        live = [p for p, n in zip(plens, lengths) if t < n]
        total += weight_bytes + kv_token_bytes * sum(p + t for p in live)
    return steps, total


def build(shape: dict, device, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            m = Qwen2ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return m


def warmup_lengths(B: int, check_every: int) -> tuple[list[int], int]:
    """Lengths that halve the live rows at every check (128 -> 64 -> ... -> 8), and the cap that covers them."""
    out, k, level = [], B, 1
    while k > 8:
        half = k // 2
        out += [level * check_every - 1] * (k - half)
        k, level = half, level + 1
    out += [level * check_every + 1] * k
    return out[:B] + [out[-1]] * (B - len(out)), level * check_every + 2


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model, short lengths (CPU smoke test)")
    ap.add_argument("--modes", default="base,compaction,both,compile",
                    help="comma-separated, of " + ",".join(MODES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--median", type=float, default=1500.0)
    ap.add_argument("--cap-share", type=float, default=0.06)
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--check-every", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    o = ap.parse_args(argv)
    bad = [m for m in o.modes.split(",") if m and m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if o.tiny:
        o.cap, o.median, o.prompt_min, o.prompt_max, o.check_every = 64, 12.0, 4, 12, 8
    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams
    from data_tools.generation.kv_cache import compiled_batch_sizes

    dev = torch.device(o.device)
    model = build(TINY if o.tiny else QWEN15, dev, o.seed)
    cfg = model.config
    B = o.prompts * o.G
    g = torch.Generator().manual_seed(o.seed + 1)
    plens = [int(torch.randint(o.prompt_min, o.prompt_max + 1, (1,), generator=g)) for _ in range(o.prompts)]
    prompts = [torch.randint(1, cfg.vocab_size, (p,), generator=g).tolist() for p in plens]
    prompt_ids = [p for p in prompts for _ in range(o.G)]
    row_plens = [len(p) for p in prompt_ids]
    lengths = draw_lengths(B, o.median, o.cap, o.cap_share, o.seed + 2)
    sp = SamplingParams(max_new_tokens=o.cap, do_sample=True, temperature=1.0)

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * next(model.parameters()).element_size()
    bw = copy_bandwidth(dev)
    steps, fbytes = floor_bytes(row_plens, lengths, weight_bytes, kv_tok)
    res = {"bench": "decode", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "rows": B, "cap": o.cap, "check_every": o.check_every,
           "lengths": {"distribution": f"lognormal(median={o.median}, P(>=cap)={o.cap_share}) clipped to [1, cap]",
                       "mean": statistics.mean(lengths), "median": statistics.median(lengths),
                       "at_cap": sum(n >= o.cap for n in lengths) / B, "max": max(lengths), "tokens": sum(lengths)},
           "prompt_tokens": {"min": min(plens), "max": max(plens)},
           "weights_gb": weight_bytes / 1e9, "kv_bytes_per_token": kv_tok, "copy_bandwidth_gbs": bw / 1e9,
           "floor": {"decode_steps": steps, "bytes_read_gb": fbytes / 1e9, "seconds": fbytes / bw}, "modes": {}}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    path = Path(o.out or Path(os.environ.get("OUT") or tempfile.gettempdir()) / "decode_bench.json")
    # first CUDA use (cuBLAS handles, allocator) outside every timing
    FastGenerator(PAD, [EOS], check_every=8).generate(model, prompt_ids[:8], SamplingParams(max_new_tokens=16))
    for mode in [m for m in o.modes.split(",") if m]:
        compaction, compile_step, kv_growth = MODES[mode]
        gen = FastGenerator(PAD, [EOS], check_every=o.check_every, compaction=compaction, compile_step=compile_step,
                            kv_growth=kv_growth)
        r: dict = {}
        if compile_step:
            wl, wcap = warmup_lengths(B, o.check_every)
            sync()
            t0 = time.perf_counter()
            gen.generate(model, prompt_ids, SamplingParams(max_new_tokens=wcap, do_sample=True), forced_lengths=wl)
            sync()
            r["warmup_s"] = time.perf_counter() - t0
            r["compiled_batch_sizes_after_warmup"] = sorted(compiled_batch_sizes(model))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        reserved0 = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        frames0 = _dynamo_frames()
        torch.manual_seed(o.seed + 3)
        sync()
        t0 = time.perf_counter()
        out = gen.generate(model, prompt_ids, sp, forced_lengths=lengths)
        sync()
        wall = time.perf_counter() - t0
        got = [len(c) for c in out]
        if got != lengths:
            raise RuntimeError(f"{mode}: completion lengths differ from the forced ones")
        last = dict(gen.last)
        r.update(wall_s=wall, tokens_per_s=sum(lengths) / wall, x_floor=wall / res["floor"]["seconds"],
                 decode_steps=last["steps"], row_steps=last["row_steps"],
                 attn_row_tokens=last["attn_row_tokens"], graphs_captured=last["graphs"],
                 compactions=last["compactions"], capture_s=last["capture_s"],
                 compiled_batch_sizes=last["compiled_batch_sizes"],
                 dynamo_frames_compiled_in_call=_dynamo_frames() - frames0,
                 peak_rise_gb=((torch.cuda.max_memory_allocated(dev) - before) / 1e9) if dev.type == "cuda" else None,
                 reserved_rise_gb=((torch.cuda.max_memory_reserved(dev) - reserved0) / 1e9)
                 if dev.type == "cuda" else None)
        r.update(kv_memory(gen, row_plens, lengths, o.cap, kv_tok, kv_growth and compaction))
        res["modes"][mode] = r
        path.write_text(json.dumps(res, indent=1))  # after every mode: a run cut short keeps what it measured
        print(f"[decode_bench] {mode}: {wall:.1f}s, {r['tokens_per_s']:.0f} tok/s, {r['x_floor']:.2f}x floor, "
              f"{r['graphs_captured']} graphs, {r['compactions']} compactions; KV cache peak {r['kv_peak_gb']:.2f} GB "
              f"(expected {r['kv_expected_gb']:.2f}, full size {r['kv_full_gb']:.2f}), peak rise "
              f"{r['peak_rise_gb'] if r['peak_rise_gb'] is not None else float('nan'):.2f} GB", flush=True)
        del gen, out
    base = res["modes"].get("base")
    if base:
        for m, r in res["modes"].items():
            r["speedup_vs_base"] = base["wall_s"] / r["wall_s"]
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return res


def kv_memory(gen, plens: list[int], lengths: list[int], cap: int, kv_tok: int, growth: bool) -> dict:
    """The decoder KV cache of ``gen``'s last call: measured peak, expected steady peak and full size (GB = 1e9 B).

    Expected: ``window_path`` on the forced lengths with ``gen``'s buckets (``max(b x cap)`` with growth,
    ``B x L`` without; ``L`` the prompt + cap rounded up by ``len_bucket``). Units: GB, and counts.
    """
    from data_tools.generation.kv_cache import kv_peak_bytes, window_path

    B, P = len(lengths), max(plens)
    L = math.ceil((P + cap) / gen.len_bucket) * gen.len_bucket
    if gen.compaction:
        path = window_path(P, lengths, cap, L, check_every=gen.check_every, attn_bucket=gen.attn_bucket,
                           min_batch_bucket=gen.min_batch_bucket, growth=growth)
        expected = kv_peak_bytes(path, B, growth, kv_tok)
    else:
        expected = B * L * kv_tok
    last = gen.last
    return {"kv_peak_gb": last.get("kv_peak_bytes", 0) / 1e9, "kv_expected_gb": expected / 1e9,
            "kv_full_gb": B * L * kv_tok / 1e9, "kv_reallocations": last.get("reallocations", 0),
            "kv_windows": [list(w) for w in last.get("windows", [])]}


def _dynamo_frames() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"].get("total", 0)) if "frames" in counters else 0
    except Exception:  # noqa: BLE001 - a counter moved
        return -1


if __name__ == "__main__":
    main()
