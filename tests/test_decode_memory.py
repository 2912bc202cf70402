"""The decoder keeps no memory across calls: one warm-up stream per generator (``FastGenerator.warmup_stream``).

Each captured window is warmed up on a side stream first. A new ``torch.cuda.Stream()`` per capture walked the
device's pool of 32 streams and cuBLAS kept a workspace per (handle, stream) it ran on (32 MiB each on an H200, never
freed): ``memory/allocated_gib`` rose by one workspace per new stream until the pool was used up (memory over many steps;
bench/RESULTS.md run 10). The CPU test holds the contract (one stream per device, reused); the GPU test measures
the allocated memory over calls that capture new windows.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_decode_compaction import compacting, rows, small_vocab_model
from data_tools.generation.fast_decoder import SamplingParams


def test_one_warmup_stream_per_device_is_reused(monkeypatch):
    made = []

    class Stream:
        def __init__(self, device=None):
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    gen = compacting()
    a = gen.warmup_stream("cuda:0")
    assert gen.warmup_stream(torch.device("cuda", 0)) is a and gen.warmup_stream("cuda:0") is a
    b = gen.warmup_stream("cuda:1")
    assert b is not a and made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert compacting().warmup_stream("cuda:0") is not a  # per generator (the async worker has its own)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_allocated_memory_is_flat_over_calls_that_capture_new_windows():
    model = small_vocab_model().cuda()
    gen = compacting(use_cuda_graph=True)  # keep_cache off: every call captures its windows again
    sp = SamplingParams(max_new_tokens=40, do_sample=False)
    after = []
    for n in range(6):
        gen.generate(model, rows()[: 12 - n], sp)  # batch buckets and windows differ between calls
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        assert gen.last["graphs"] >= 2
    assert len(gen._streams) == 1
    assert max(after[1:]) - min(after[1:]) < 2**20, [a / 2**20 for a in after]  # no workspace (>= 8 MiB) per call
