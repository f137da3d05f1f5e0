# accelerate-txn developer entry points. Every target builds what it needs from constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= --quiet --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: venv test demo lint bench test-accelerate clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt torch==2.13.0
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[test]'
	touch $@

## The whole suite (unit + real 2-process gloo tests).
test: venv
	$(PY) -m ruff check accelerate_txn tests benchmarks examples
	$(PY) -m pytest -q $(PYTEST_ARGS)

## 2-process FSDP training on CPU: checkpoint, kill -9 mid-save, resume, prove nothing was lost.
demo: venv
	$(PY) examples/demo.py --output demo-output

lint: venv
	$(PY) -m ruff check accelerate_txn tests benchmarks examples

bench: venv
	$(PY) benchmarks/run_all.py

## The distributed tests again on another validated Accelerate: make test-accelerate ACCELERATE_VERSION=1.13.0
ACCELERATE_VERSION ?= 1.13.0
ALT_VENV := .venv-accelerate-$(ACCELERATE_VERSION)
test-accelerate:
	$(PYTHON) -m venv $(ALT_VENV)
	grep -v '^accelerate==' constraints.txt > $(ALT_VENV)/constraints.txt
	echo 'accelerate==$(ACCELERATE_VERSION)' >> $(ALT_VENV)/constraints.txt
	$(ALT_VENV)/bin/pip install $(PIP_FLAGS) -c $(ALT_VENV)/constraints.txt torch==2.13.0
	$(ALT_VENV)/bin/pip install $(PIP_FLAGS) -c $(ALT_VENV)/constraints.txt -e '.[test]'
	$(ALT_VENV)/bin/python -c "import accelerate; assert accelerate.__version__ == '$(ACCELERATE_VERSION)', accelerate.__version__"
	$(ALT_VENV)/bin/python -m pytest -q -m distributed $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-accelerate-* demo-output *.egg-info
