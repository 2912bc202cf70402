"""The fast generation path under FSDP2, on the CPU: 2 processes (gloo), a tiny random Qwen2 sharded the way
accelerate's ``fsdp_version: 2`` config shards it (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``).

Checks, on every rank: ``fast_generate_single_turn`` under FSDP2 gives exactly the greedy completions of the
same model unsharded in one process (fp32, and bf16 ``MixedPrecisionPolicy`` as in configs/accelerate/fsdp.yaml);
the weights are all-gathered once per call (one all-gather per FSDP parameter group, however many decode
steps), no FSDP forward hook runs inside the call, ranks may decode different numbers of steps; afterwards
the parameters are DTensor shards again, the hooks are back and an ordinary FSDP forward still matches; after
a training step through FSDP the fast path decodes with the updated weights.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from trainers.fast_generation import FSDPHooksNotFound, fast_path_unsupported, fsdp2_full_weights

PAD, EOS = 0, [1]


def n_new(rank: int) -> int:
    """Different decode lengths per rank: a collective left inside a forward would hang (then time out)."""
    return 12 - 5 * rank


def tiny_model(param_dtype=torch.float32, seed=0):
    """Tied embeddings as Qwen2.5-1.5B. ``param_dtype`` casts the parameters only (buffers stay fp32), as
    FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does to the gathered weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=PAD, eos_token_id=EOS[0])
    model = Qwen2ForCausalLM(cfg).float().eval()
    for p in model.parameters():
        p.data = p.data.to(param_dtype)
    return model


def rank_prompts(rank: int) -> list[list[int]]:
    """Different prompts, counts and lengths per rank (G = 2 samples of each prompt in a row)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(2 + rank):
        p = torch.randint(3, 90, (int(torch.randint(3, 9 + 4 * rank, (1,), generator=g)),), generator=g).tolist()
        out += [p, p]
    return out


def reference(dtype) -> dict[int, list[list[int]]]:
    """Greedy completions of the unsharded model in this process, per rank's prompts."""
    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams

    model = tiny_model(dtype)
    gen = FastGenerator(PAD, EOS, len_bucket=16, check_every=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add wake-up latency on a loaded CPU
    try:
        return {r: gen.generate(model, rank_prompts(r), SamplingParams(max_new_tokens=n_new(r), do_sample=False))
                for r in (0, 1)}
    finally:
        torch.set_num_threads(threads)


def stub_trainer(model, max_new_tokens: int):
    """What ``fast_generate_single_turn`` reads from an ``OPDTrainer`` prepared by accelerate with FSDP2."""
    from transformers import GenerationConfig

    state = SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=2))
    acc = SimpleNamespace(state=state, unwrap_model=lambda m, **k: m)
    return SimpleNamespace(
        accelerator=acc, is_fsdp_enabled=True, model_wrapped=model, generation_kwargs={},
        generation_config=GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD,
                                           eos_token_id=EOS),
        args=SimpleNamespace(ds3_gather_for_generation=True, gradient_checkpointing_kwargs=None),
        _tokenizer=SimpleNamespace(pad_token_id=PAD), eos_token_ids=EOS)


def shard_like_accelerate(model, rank: int, mixed_precision: str):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
                                            reshard_after_forward=True, cpu_ram_efficient_loading=False)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    acc = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed_precision,
                          is_main_process=rank == 0, device=torch.device("cpu"), torch_device_mesh=None,
                          parallelism_config=None)
    return fsdp2_prepare_model(acc, model)


def _worker(rank: int, world: int, port: int, out_dir: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.tensor import DTensor

    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams
    from trainers.fast_generation import fast_generate_single_turn

    torch.set_num_threads(1)  # 2 processes on a small CPU: no oversubscription
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    counts = {"pre_forward": 0, "all_gather": 0}
    orig_pre_forward = _fsdp_param_group.FSDPParamGroup.pre_forward
    orig_all_gather = _fsdp_param_group.foreach_all_gather  # one call = one group's all-gather

    def counting_pre_forward(self, *a, **k):
        counts["pre_forward"] += 1
        return orig_pre_forward(self, *a, **k)

    def counting_all_gather(*a, **k):
        counts["all_gather"] += 1
        return orig_all_gather(*a, **k)

    _fsdp_param_group.FSDPParamGroup.pre_forward = counting_pre_forward
    _fsdp_param_group.foreach_all_gather = counting_all_gather
    res = {}
    try:
        for mp in ("no", "bf16"):
            model = shard_like_accelerate(tiny_model(), rank, mp)
            mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
            states = {id(s): s for s in (m._get_fsdp_state() for m in mods)}.values()  # grouped modules share one
            groups = sum(len(s._fsdp_param_groups) for s in states)
            hooks_before = [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in mods]
            tr = stub_trainer(model, n_new(rank))
            runs = []
            for _ in range(2):  # the second call gathers again (and re-captures on a GPU)
                counts.update(pre_forward=0, all_gather=0)
                got = fast_generate_single_turn(tr, rank_prompts(rank))
                runs.append({"completions": got, **counts})
            r = {"runs": runs, "param_groups": groups, "fsdp_modules": len(mods),
                 "all_dtensor_after": all(isinstance(p, DTensor) for p in model.parameters()),
                 "hooks_restored": hooks_before == [(list(m._forward_pre_hooks), list(m._forward_hooks))
                                                    for m in mods]}
            # an ordinary FSDP forward afterwards: hooks fire, weights gathered by FSDP, same logits as unsharded
            counts.update(pre_forward=0, all_gather=0)
            ids = torch.tensor([rank_prompts(0)[0]])
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
            with torch.no_grad():
                ref_logits = tiny_model(torch.bfloat16 if mp == "bf16" else torch.float32)(input_ids=ids).logits
            r["forward_after"] = {"pre_forward": counts["pre_forward"],
                                  "max_abs_diff": float((logits - ref_logits.float()).abs().max())}
            # a training step through FSDP (forward with hooks, backward, reduce-scatter, SGD), then generate
            # again: same completions as an unsharded model holding the updated (gathered) weights
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            model.train()
            ids = torch.tensor([rank_prompts(rank)[-1]])
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            got = fast_generate_single_turn(tr, rank_prompts(rank))
            plain = tiny_model()
            changed = any(not torch.equal(full[n], p) for n, p in plain.named_parameters())
            plain.load_state_dict(full, strict=False)  # the tied lm_head follows embed_tokens
            for p in plain.parameters():
                p.data = p.data.to(torch.bfloat16 if mp == "bf16" else torch.float32)
            want = FastGenerator(PAD, EOS, len_bucket=16, check_every=4).generate(
                plain, rank_prompts(rank), SamplingParams(max_new_tokens=n_new(rank), do_sample=False))
            r["after_train"] = {"weights_changed": changed, "same": got == want,
                                "completions_changed": got != runs[0]["completions"],  # not stale weights
                                "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters())}
            res[mp] = r
    finally:
        _fsdp_param_group.FSDPParamGroup.pre_forward = orig_pre_forward
        _fsdp_param_group.foreach_all_gather = orig_all_gather
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fast_generation_under_fsdp2_matches_unsharded(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    refs = {"no": reference(torch.float32), "bf16": reference(torch.bfloat16)}
    for rank in range(world):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mpol, r in res.items():
            ref = refs[mpol][rank]
            assert len(ref) == len(rank_prompts(rank)) and all(len(c) >= 1 for c in ref)
            assert r["param_groups"] == 4  # 3 decoder layers + the (norm, embed, tied lm_head) group; root has none
            for run in r["runs"]:
                assert run["completions"] == ref, (rank, mpol)
                assert run["pre_forward"] == 0  # no FSDP forward hook ran during generation
                assert run["all_gather"] == r["param_groups"]  # one all-gather per group per call
            assert r["all_dtensor_after"] and r["hooks_restored"]
            assert r["forward_after"]["pre_forward"] >= r["param_groups"]
            assert r["forward_after"]["max_abs_diff"] < (5e-2 if mpol == "bf16" else 1e-5)
            assert r["after_train"] == {"weights_changed": True, "same": True, "completions_changed": True,
                                        "all_dtensor": True}


def test_fsdp2_full_weights_is_a_no_op_without_fsdp():
    model = tiny_model()
    params = [p.data_ptr() for p in model.parameters()]
    with fsdp2_full_weights(model) as m:
        assert m is model
    assert params == [p.data_ptr() for p in model.parameters()]


def test_one_process_fsdp2_and_missing_hooks(monkeypatch):
    """World size 1 (the bench's 1-GPU reference runs FSDP with one process): same completions as unsharded.
    If FSDP2's hooks cannot be identified (an internal changed): nothing gathered, hooks kept, TRL's path used."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainers import fast_generation as generation

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process, no env vars
    try:
        model = shard_like_accelerate(tiny_model(), 0, "no")
        assert generation.fast_generate_single_turn(stub_trainer(model, n_new(0)), rank_prompts(0)) \
            == reference(torch.float32)[0]
        assert all(isinstance(p, DTensor) for p in model.parameters())

        before = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
        monkeypatch.setattr(generation, "_hook_of", lambda hook, state: False)
        with pytest.raises(FSDPHooksNotFound):
            with fsdp2_full_weights(model):
                pass
        assert before == [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert generation.fast_generate_single_turn(stub_trainer(model, n_new(0)), rank_prompts(0)) is None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ds,fsdp,expect", [
    (None, None, None), (None, 2, None), (None, 1, "FSDP version 1"), (3, None, "ZeRO-3"), (2, None, None)])
def test_fast_path_unsupported(ds, fsdp, expect):
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=ds) if ds else None,
                            fsdp_plugin=SimpleNamespace(fsdp_version=fsdp) if fsdp else None)
    tr = SimpleNamespace(accelerator=SimpleNamespace(state=state), is_fsdp_enabled=fsdp is not None)
    why = fast_path_unsupported(tr)
    assert (why is None) if expect is None else (expect in why)
