"""The one module that knows which TRL is installed: every TRL name the trainers use is imported from here.

opd runs on TRL 0.29 to 1.16 (docs/design.md section 1: the formal image's TRL is whatever its base
image carried, and images of vLLM 0.17's time carry 0.29 to 1.x). What differs across that range, and what stands
in for it where TRL lacks it:

- ``DistillationTrainer`` / ``DistillationConfig``: TRL's top level from 1.10 on. Earlier, the text-only subset
  ``OPDTrainer`` builds on (``trainers.text_distill_trainer``: on-policy generation, padding, the generation-batch
  buffer, the backbone's last hidden state, metric averaging) on transformers' ``Trainer``.
- The chunked output-head kernels (``trl.kernels``, TRL >= 1.x): ``trainers.chunked_heads``, the same two
  quantities by torch tiles (no Triton).
- ``unwrap_model_for_generation`` lost / gained keyword arguments: ``unwrap_for_generation`` passes only those the
  installed signature takes.

``TRL_BASE`` names which base is in use ("trl" or "opd"); the run's manifest and metrics record it.
"""

from __future__ import annotations

import trl
from trl.trainer.utils import pad, shuffle_sequence_dict, split_tensor_dict  # present from 0.29 to 1.16

try:
    from trl import DistillationConfig, DistillationTrainer  # TRL >= 1.10

    TRL_BASE = "trl"
except ImportError:  # TRL 0.29 - 1.9: the text-only base of our own
    from trainers.text_distill_config import DistillationConfig
    from trainers.text_distill_trainer import DistillationTrainer

    TRL_BASE = "opd"

try:
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    HEAD_KERNELS_FROM = "trl"
except ImportError:
    from trainers.chunked_heads import ChunkedDivergenceFunction, ChunkedLogProbFunction

    HEAD_KERNELS_FROM = "opd"

from trainers.trl_calls import profiling, unwrap_for_generation  # noqa: E402

TRL_VERSION = getattr(trl, "__version__", "?")


__all__ = ["DistillationConfig", "DistillationTrainer", "TRL_BASE", "TRL_VERSION", "HEAD_KERNELS_FROM",
           "ChunkedLogProbFunction", "ChunkedDivergenceFunction", "pad", "shuffle_sequence_dict",
           "split_tensor_dict", "unwrap_for_generation", "profiling"]
