"""The generation layer: everything that only generates, below the trainer and the stages.

- ``engines``: the engines of stage one and evaluation (``VLLMEngine``, ``HFEngine``), the ``Sample`` they yield,
  ``make_engine`` and ``ENGINES``, the engine settings both stages share (``EngineSettings``), ``derive_seed``.
- ``processes``: the vLLM engine's processes (die with the stage, pid files, watchdog, ``EngineDead``,
  ``exit_on_sigterm``); standard library and psutil only.
- ``fast_decoder``: ``FastGenerator``, the static-cache / CUDA-graph decoder of the ``hf`` engine and of the
  trainer's rollouts (``trainers.fast_generation``, ``trainers.async_rollouts``).
- ``kv_cache``: the decoder's KV cache (``DecodeKV``), its buckets, its attention and the compiled decode layers.
- ``fallback``: one-line fallbacks (``say_once``) and the compile guard (``guarded_compile``).

Import from the modules (``from data_tools.generation.engines import make_engine``): this file imports nothing, so
importing the light ``processes`` (as workers and vLLM's spawned children do) does not load torch.
"""
