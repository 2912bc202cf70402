"""Curriculum sampler over stage one's ``curriculum.parquet``.

It honours the contract of TRL's ``RepeatSampler`` (``trl/trainer/utils.py``), which
``DistillationTrainer._prepare_inputs`` relies on: the dataloader reads a whole *generation batch*
at a time, and each generation batch must come ``repeat_count`` (= gradient-accumulation steps x
reuse iterations) times in a row, because completions are generated once for the first copy and
the buffered result is reused for the rest. Within a batch every prompt appears ``num_generations``
times back to back: the G samples of one prompt form its reward group.

An epoch visits every row at least once; its length is rounded up to whole generation batches by
wrapping around to the start of the order, so a data set smaller than one batch still trains and
nothing is dropped. The trainer runs epoch after epoch (``max_steps`` is effectively unbounded), so
training never stops because the data ran out; only the wall clock ends it.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

MODES = ("ordered", "shuffled", "mixed")


def epoch_order(buckets: Sequence[int], order: Sequence[int], *, mode: str = "ordered", mix: float = 0.0,
                shuffle_within_bucket: bool = True, seed: int = 0, epoch: int = 0) -> list[int]:
    """Row indices for one pass over the data.

    Args:
        buckets: ``(n_rows,)`` difficulty bucket per row (0 = easiest).
        order: ``(n_rows,)`` global easy-to-hard index per row (``curriculum_index``).
        mode: ``ordered``: bucket by bucket, easiest first (by ``curriculum_index`` inside a bucket,
            or a seeded shuffle inside each bucket if ``shuffle_within_bucket``); ``shuffled``: a
            fresh permutation of all rows; ``mixed``: the ordered sequence with a share ``mix`` of
            its positions replaced by rows drawn uniformly from the whole set (replay of other
            difficulties while the curriculum advances).
        seed, epoch: the permutation is a function of both, so a resumed run sees the same order.

    Raises:
        ValueError: unknown mode, ``mix`` outside [0, 1], or lengths that differ.
    """
    if mode not in MODES:
        raise ValueError(f"unknown curriculum mode {mode!r}; choose one of {MODES}")
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"curriculum_mix must be in [0, 1], got {mix}")
    b, o = np.asarray(buckets, dtype=np.int64), np.asarray(order, dtype=np.int64)
    if b.shape != o.shape:
        raise ValueError(f"buckets and order differ in length ({b.shape} vs {o.shape})")
    n = len(b)
    rng = np.random.default_rng([seed, epoch])
    if mode == "shuffled":
        return rng.permutation(n).tolist()
    if shuffle_within_bucket:
        # random key inside each bucket: lexsort sorts by the last key first
        idx = np.lexsort((rng.random(n), b))
    else:
        idx = np.lexsort((o, b))
    if mode == "mixed" and mix > 0 and n > 1:
        replace = rng.random(n) < mix
        idx = idx.copy()
        idx[replace] = rng.integers(0, n, int(replace.sum()))
    return idx.tolist()


class CurriculumSampler(Sampler[int]):
    """Index sampler yielding ``[gen batch] x repeat_count`` blocks, each prompt ``num_generations`` times.

    Args:
        buckets, order: per-row curriculum columns (see ``epoch_order``).
        prompts_per_batch: distinct prompts in one *global* generation batch
            (= per_device_train_batch_size x world_size x gradient_accumulation_steps / num_generations).
        num_generations: G, consecutive copies of each prompt.
        repeat_count: times each generation batch is repeated in a row (GA x num_iterations).
        mode, mix, shuffle_within_bucket, seed: see ``epoch_order``.

    ``set_epoch`` (called by the transformers Trainer every epoch) selects the pass; without it each
    new iteration advances to the next epoch by itself.
    """

    def __init__(self, buckets: Sequence[int], order: Sequence[int], *, prompts_per_batch: int, num_generations: int,
                 repeat_count: int = 1, mode: str = "ordered", mix: float = 0.0, shuffle_within_bucket: bool = True,
                 seed: int = 0):
        if len(buckets) == 0:
            raise ValueError("the curriculum is empty: nothing to train on")
        if prompts_per_batch < 1 or num_generations < 1 or repeat_count < 1:
            raise ValueError("prompts_per_batch, num_generations and repeat_count must be >= 1")
        self.buckets, self.order = list(buckets), list(order)
        self.prompts_per_batch, self.num_generations, self.repeat_count = prompts_per_batch, num_generations, repeat_count
        self.mode, self.mix, self.shuffle_within_bucket, self.seed = mode, mix, shuffle_within_bucket, seed
        epoch_order(self.buckets[:1], self.order[:1], mode=mode, mix=mix)  # validate mode / mix now
        self.epoch = 0
        self.batches_per_epoch = math.ceil(len(self.buckets) / prompts_per_batch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self, epoch: int) -> list[list[int]]:
        """The generation batches (lists of distinct row indices) of one epoch."""
        rows = epoch_order(self.buckets, self.order, mode=self.mode, mix=self.mix,
                           shuffle_within_bucket=self.shuffle_within_bucket, seed=self.seed, epoch=epoch)
        total = self.batches_per_epoch * self.prompts_per_batch
        # wrap around so the last batch is full (and a tiny data set fills a batch)
        rows = [rows[i % len(rows)] for i in range(total)]
        return [rows[i : i + self.prompts_per_batch] for i in range(0, total, self.prompts_per_batch)]

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        self.epoch += 1  # the next pass differs even if nobody calls set_epoch
        for batch in self.batches(epoch):
            for _ in range(self.repeat_count):
                for idx in batch:
                    for _ in range(self.num_generations):
                        yield idx

    def __len__(self) -> int:
        return self.batches_per_epoch * self.prompts_per_batch * self.num_generations * self.repeat_count
