# One-line commands; everything lives in bench_lib (python -m bench_lib --help).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=
WORKERS ?= 2
# The tests keep their bytecode (git-ignored __pycache__) even where the environment says
# PYTHONDONTWRITEBYTECODE=1, as many containers do: without it every pytest worker rewrites
# every test module's asserts, and every process a test starts compiles bench_lib, again.
TESTENV := PYTHONDONTWRITEBYTECODE=

.PHONY: venv bench test test-fast test-compat lint env smoke parity tune distance gate regress baseline report docs clean help

help:            ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)   ## create .venv and install the project (reused when up to date)

bench: venv      ## run the default sweep for this machine's rig, then write its report (ARGS="..." adds CLI flags)
	$(PY) -m bench_lib run --profile default --report $(ARGS)

report: venv     ## write report.html (+ PNGs) for the newest `run` folder (results/latest-run), or RUNS="dir1 dir2"
	@runs="$(RUNS)"; test -n "$$runs" || ! test -e results/latest-run || runs=results/$$(readlink results/latest-run); \
	test -n "$$runs" || { echo "error: no run folder: results/latest-run (the newest folder of python -m bench_lib run) does not exist; run make bench first, or name folders: make report RUNS=results/DIR" >&2; exit 2; }; \
	$(PY) -m bench_lib report $$runs

parity: venv     ## train every strategy on real data from the same weights; exit 1 when one learns differently
	$(PY) -m bench_lib parity $(ARGS)

tune: venv       ## race one workload's configurations and recommend one (ARGS="--image-sizes 96" picks another)
	$(PY) -m bench_lib tune --profile default --image-sizes 64 $(ARGS)

distance: venv   ## time the pairwise distance of a conv weight's kernels: loop, blocked cdist, split over devices; exit 1 when one disagrees
	$(PY) -m bench_lib distance $(ARGS)

smoke: venv      ## the smoke sweep (all seed strategies, tiny grid)
	$(PY) -m bench_lib run --profile smoke $(ARGS)

env: venv        ## print the environment a run would record
	$(PY) -m bench_lib env

test: venv       ## run the whole test suite on WORKERS=2 pytest workers (GPU tests skip without GPUs)
	$(TESTENV) $(PY) -m pytest -n $(WORKERS) --dist worksteal $(ARGS)

TORCH ?=
COMPAT := .venv-torch-$(TORCH)

$(COMPAT)/.installed: pyproject.toml
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet --upgrade pip
	PIP_CONSTRAINT=/dev/null $(COMPAT)/bin/python -m pip install --quiet --no-cache-dir "torch==$(TORCH)" torchvision -e '.[test]'
	touch $@

test-compat:     ## the compatibility subset (every strategy) on another torch in its own venv: make test-compat TORCH=2.11.0
	@case "$(TORCH)" in [0-9]*.[0-9]*.[0-9]*) ;; *) echo "error: name a torch release: make test-compat TORCH=2.11.0 (CI runs 2.10.0, 2.11.0 and 2.15.0)" >&2; exit 2;; esac
	@$(MAKE) --no-print-directory $(COMPAT)/.installed
	$(COMPAT)/bin/python -c "import torch, torchvision; print('compatibility pass on torch', torch.__version__, 'torchvision', torchvision.__version__)"
	$(TESTENV) $(COMPAT)/bin/python -m pytest -n $(WORKERS) --dist worksteal -m compat $(ARGS)

test-fast: venv  ## the unit layer only (no process started, no real model trained) on WORKERS=2 workers: the edit-run loop
	$(TESTENV) $(PY) -m pytest -n $(WORKERS) --dist worksteal -m "not integration" $(ARGS)

BASE ?= $(shell git merge-base HEAD origin/main 2>/dev/null || git merge-base HEAD main 2>/dev/null)

gate: venv       ## measure BASE (default: the merge base with main) and this working tree in one job, interleaved; exit 1: regression
	@test -n "$(BASE)" || { echo "error: no merge base with main or origin/main; name one: make gate BASE=REF" >&2; exit 2; }
	$(PY) -m bench_lib gate --base $(BASE) $(ARGS)

regress: venv    ## run the ci profile, gate it against results/baseline/ (exit 1: regression)
	$(PY) -m bench_lib run --profile ci --quiet --compare-to results/baseline $(ARGS)

baseline: venv   ## run the ci profile and store it as this hardware's baseline in results/baseline/
	$(PY) -m bench_lib run --profile ci --quiet --save-baseline results/baseline $(ARGS)

docs: venv       ## rewrite the generated reference pages (docs/cli.md, docs/schema.md, docs/profiles.md)
	$(PY) -m bench_lib.reference

lint: venv       ## ruff over the library, tests and benchmarks; mypy --strict over bench_lib (config in pyproject.toml)
	$(PY) -m ruff check bench_lib tests benchmarks
	$(PY) -m mypy

clean:           ## remove caches (keeps .venv and results/)
	rm -rf .pytest_cache build *.egg-info
