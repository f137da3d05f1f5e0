# accelerate-txn developer entry points. Every target builds what it needs from constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= --quiet --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: venv test demo lint bench test-accelerate test-matrix test-matrix-table test-matrix-full test-newest crash-sweep test-gpu docs clean  # docs/ exists: docs must be phony

## One environment, .venv, built in two layers, each with its marker file:
## - $(VENV)/.base-installed: the CPU build of torch and the package with its base dependencies only (about 35
##   packages): all that `make demo` and the accelerate-txn command need;
## - $(VENV)/.installed (make venv): the same environment plus the test extra and the real clients (about 100
##   packages more) that the suite needs.
## `make demo` then `make test` adds the extras to the same .venv; after `make venv`, `make demo` installs nothing.
## The base layer is an order-only prerequisite (after |): it must exist, but rebuilding it alone (say a .venv from
## before the layers, with .installed only) does not reinstall the extras.
venv: $(VENV)/.installed

$(VENV)/.base-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt torch==2.13.0 -e .
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt | $(VENV)/.base-installed
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,clients]'
	touch $@

## The whole suite (unit + real 2-process gloo tests).
test: venv
	$(PY) -m ruff check accelerate_txn tests benchmarks examples
	$(PY) -m pytest -q $(PYTEST_ARGS)

## 2-process FSDP training on CPU: checkpoint, kill -9 mid-save, resume, prove nothing was lost. Needs only the
## base layer of .venv (no extras: examples/demo.py and examples/demo_train.py import torch and accelerate_txn).
demo: $(VENV)/.base-installed
	$(PY) examples/demo.py --output demo-output

## Seeded random-instant kill -9 sweep: 50 trials of a real 2-rank FSDP1 run on CPU (CRASH_SWEEP_ARGS="--trials 200 --seed 1";
## add --fsdp-version 2 for FSDP2, --async for asynchronous saves).
CRASH_SWEEP_ARGS ?= --trials 50
crash-sweep: venv
	$(PY) -m tests.crash_sweep $(CRASH_SWEEP_ARGS)

## For a machine with a GPU (not CI): NCCL, one process, protected round trip on CUDA, parameter CPU offload, CUDA RNG.
## Prints why it skipped where no GPU is visible.
test-gpu: venv
	$(PY) tests/scripts/gpu_check.py

## The documentation site: MkDocs + Material, strict (any warning fails), into site/, with the API reference
## generated from the docstrings (mkdocstrings; griffe reads the source, nothing is imported). Its tools live in
## their own environment (.venv-docs, pinned by docs/requirements.txt), apart from the library's constraints.txt.
## First a Markdown lint: a list must have a blank line before and after it (MD032), or Python-Markdown renders
## it as a paragraph with a literal "- ". After the build, tests/project/test_docs.py checks the built site: every public
## name on the reference page, no list item left inside a paragraph.
DOCS_VENV ?= .venv-docs
DOCS_LINT := $(DOCS_VENV)/bin/pymarkdown --strict-config --set 'plugins.selectively_enable_rules=$$!true' \
	--enable-rules md032
docs: $(DOCS_VENV)/.installed
	$(DOCS_LINT) scan --recurse docs
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict -d site
	$(DOCS_VENV)/bin/python tests/project/test_docs.py site

$(DOCS_VENV)/.installed: docs/requirements.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install $(PIP_FLAGS) -r docs/requirements.txt
	touch $@

lint: venv
	$(PY) -m ruff check accelerate_txn tests benchmarks examples

## Every benchmark exactly as docs/benchmarks.md records it; writes benchmarks/results/*.json and docs/img/*.png.
bench: venv
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[bench]'
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

## The version matrix (CI): MATRIX_TESTS on a covering set of accelerate_txn/validated.json -- every torch minor
## 2.7-2.15, every Accelerate minor 1.7-1.16 and every Python 3.10-3.13 at least once: the diagonal (torch 2.N with
## Accelerate 1.N) and the edges (the newest pair; the default torch with the oldest and newest Accelerate), about a
## dozen jobs (.ci/matrix.py --cover --list prints them). One environment per (Python, torch), installed by uv, with
## Accelerate swapped inside it, the next one installed in the background while the current one's tests run, each
## deleted when done. --python/--torch/--accelerate in MATRIX_ARGS name jobs of the whole table instead, e.g.
## make test-matrix MATRIX_ARGS="--torch 2.13.0 --accelerate 1.10.1 --keep".
## MATRIX_TESTS is the one definition of the compact distributed subset: the orig_params round trip (save,
## fresh-optimizer restore, corruption and configuration refusal, a hook failing on one rank, no overwrite),
## kill -9 mid-save and resume, ranks that disagree, a DCP exception on one rank, a restore failing part way,
## and an elastic resume (FSDP1 flat parameters, 2 -> 3 ranks, exact).
MATRIX_TESTS ?= tests/fsdp/test_distributed.py tests/accelerate/test_elastic.py -k "orig_params or kill_9 or ranks_with_different_configuration or silently_empty_native or dcp_checkpoint_exception or restore_failing_part_way or flat_parameters_and_another_optimizer"
## MATRIX_FSDP2_TESTS run as well on the rows marked "fsdp2": true: FSDP2's protected save, an exact resume into a
## fresh model and optimizer, a flipped byte refused, a whole-job kill -9 mid-write then an exact restart.
MATRIX_FSDP2_TESTS ?= tests/fsdp/test_fsdp2.py tests/core/test_crash_fsdp2.py -k "save_is_protected_and_published or resume_into_a_fresh_model or flipped_byte_in_a_dcp or kill_mid_flush_of_a_fresh_run"
MATRIX_ARGS ?=
test-matrix:
	$(PYTHON) .ci/matrix.py --cover --fsdp2-tests '$(MATRIX_FSDP2_TESTS)' $(MATRIX_ARGS) -- $(MATRIX_TESTS)

## The canary on the newest releases (CI, after the matrix): the newest torch, Accelerate and transformers the package
## index serves (asked at run time: .ci/newest.py), installed by uv into .venv-newest with this package (test extra)
## and constraints.txt's other pins where they resolve; the gate is asked there, and the tests of each front end and
## path it protects run: MATRIX_TESTS and MATRIX_FSDP2_TESTS (the Accelerate front end), TRAINER_NEWEST_TESTS and
## TRAINER_NEWEST_FSDP2_TESTS (the Trainer). A release that does not install, or that the gate turns native (its
## reasons printed), is reported and passes; protected tests that fail (or collect nothing) fail: the evidence
## missed a change. The environment is deleted at the end (NEWEST_ARGS=--keep keeps it; --torch, --accelerate,
## --transformers name releases instead of the newest).
## TRAINER_NEWEST_TESTS (FSDP1): a protected save publishes checkpoint-N with a verified manifest; kill -9 of one
## rank or of the whole job at each phase of a save, each followed by resume_from_checkpoint=True, which takes the
## newest complete checkpoint with its optimizer state bitwise and ends exactly as the uninterrupted run.
TRAINER_NEWEST_TESTS ?= tests/trainer/test_trainer.py -k "protected_trainer_save_publishes or kill_9_at_each_phase or fsdp1_resume_restores_the_optimizer"
## TRAINER_NEWEST_FSDP2_TESTS: the whole job killed mid-save resumes exactly (every checkpoint's manifest verified);
## each damaged file class (model and optimizer shards, scheduler, RNG, Trainer state, missing, extra) refused on
## every rank before anything is loaded.
TRAINER_NEWEST_FSDP2_TESTS ?= tests/trainer/test_trainer.py -k "kill_9_of_the_whole_job_mid_save or each_damaged_file_class"
NEWEST_ARGS ?=
test-newest:
	$(PYTHON) .ci/newest.py --fsdp2-tests '$(MATRIX_FSDP2_TESTS)' --trainer-tests '$(TRAINER_NEWEST_TESTS)' \
		--trainer-fsdp2-tests '$(TRAINER_NEWEST_FSDP2_TESTS)' $(NEWEST_ARGS) -- $(MATRIX_TESTS)

## Every job of the table (not CI: each row was run when it was added; about 25 jobs, an hour on 2 cores).
test-matrix-table:
	$(PYTHON) .ci/matrix.py --fsdp2-tests '$(MATRIX_FSDP2_TESTS)' $(MATRIX_ARGS) -- $(MATRIX_TESTS)

## The whole rectangle (not CI: 90 cells, about two hours on 2 cores): every torch release of the table with every
## Accelerate release of the table, on Python 3.11, MATRIX_TESTS in each; cells outside the table run with
## ACCELERATE_TXN_ALLOW_UNVALIDATED=1. Writes .ci/matrix-full-run.md (which docs/versions.md shows) and its .json
## after every cell; an interrupted run continues with make test-matrix-full MATRIX_ARGS=--resume.
test-matrix-full:
	$(PYTHON) .ci/matrix.py --rectangle --include-default --record .ci/matrix-full-run.md $(MATRIX_ARGS) -- $(MATRIX_TESTS)

clean:
	rm -rf $(VENV) .venv-accelerate-* .venv-matrix .venv-newest .venv-docs site demo-output *.egg-info
