# The two commands of the course: `make lab` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.distlab-installed
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=300

.PHONY: lab test test-times test-portable regen exercises install bench gpu-check clean book test-browser

install: $(STAMP)

# pip takes torch==2.13.0 (pinned in pyproject.toml); the CPU wheel when one is on local disk.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# JupyterLab refuses to run as root (containers, some cloud VMs) unless told it may.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP) $(VENV)/.distlab-ft-installed
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) --notebook-dir=. $(LAB_ARGS) notebooks/00_why_distributed.ipynb

# nbgrader is an instructor's tool: installed for the tests that prove the workbooks grade, not by
# `make lab` (learners would see its menus).
# Six pytest workers, one file (one notebook) per worker at a time, the longest files first
# (tests/budget_walls.json): much of a test's wall time is ranks waiting on each other, kernels
# and torchrun starting, so several share 2 cores well (measured on 2 quiet cores: three workers
# kept 1.27 cores busy, four 1.64; with the shared kernels, five 7:30 and six 7:23 for the same
# suite). `make test WORKERS=0` runs them in one.
# nbval runs the chapters (notebooks/) in one kernel per worker, put back as new between two
# chapters (DISTLAB_SHARED_KERNEL, tests/shared_kernel.py: a kernel is ≈ 5 CPU-s before the first
# line runs); the solved workbooks run in ONE kernel, judged by nbval's rules
# (tests/test_solutions.py); test-portable runs nbval itself, a kernel per notebook, on both.
# PYTHONDONTWRITEBYTECODE emptied: where a machine sets it, every one of the suite's processes
# compiled the course and rewrote the tests' asserts again (≈ 4 CPU-s per pytest worker).
# tests/fast_imports.py: what each test process need not import (≈ 1.7 CPU-s each).
WORKERS ?= 6
test: $(STAMP) $(VENV)/.distlab-grading-installed $(VENV)/.distlab-hta-installed \
		$(VENV)/.distlab-ft-installed
	DISTLAB_NO_PROGRESS=1 DISTLAB_SHARED_KERNEL=1 PYTHONDONTWRITEBYTECODE= PYTHONPATH=tests \
		$(PY) -m pytest -p fast_imports tests notebooks $(NBVAL) --timeout=900 -q \
		$(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# make test, then each file's wall seconds written to tests/budget_walls.json (the order in which
# make test hands files to its workers: longest first). Run it on a quiet machine after a change
# that moves a file's time by tens of seconds.
test-times:
	$(MAKE) test DISTLAB_BUDGET_SAVE=1

# nbval again, under another CPU's rounding (tests/perturbed.env: ATen's scalar kernels, MKL's
# portable code path): a stored output that prints round-off digits fails here as it would on the
# next instructor's machine. .ci/run runs it after `make test` (it would double make test's time).
PERTURBED := $(shell grep -v '^\s*\#' tests/perturbed.env | grep '=')
# `-p conftest` (tests/ on the path): tests/conftest.py's retry of a kernel that dies at birth
# (a port taken between its choice and its bind), which `make test` gets by collecting tests/.
test-portable: $(STAMP) $(VENV)/.distlab-hta-installed $(VENV)/.distlab-ft-installed
	env $(PERTURBED) DISTLAB_NO_PROGRESS=1 PYTHONDONTWRITEBYTECODE= PYTHONPATH=tests $(PY) -m pytest -p fast_imports -p conftest \
		notebooks solutions $(NBVAL) --timeout=900 -q \
		$(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# The course as a static site from the stored outputs (nothing is executed): docs/_build/html.
# -W --keep-going: a broken internal link (document, anchor, image) fails the build.
book: $(STAMP) $(VENV)/.distlab-book-installed
	$(VENV)/bin/sphinx-build -b html -c docs -W --keep-going -q . docs/_build/html
	@echo "site: docs/_build/html/index.html"

$(VENV)/.distlab-grading-installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[grading]'
	touch $@

# Holistic Trace Analysis referees the reading of a GPU trace, in the tests and in
# chapter 11 (whose stored output is HTA's, so regen and test-portable need it too); `make lab`
# leaves it out (pandas, plotly), and the chapter's cell says how to get it.
$(VENV)/.distlab-hta-installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[hta]'
	touch $@

# torchft (chapter 13's replica groups that survive a lost member, its LocalSGD and DiLoCo):
# Linux x86_64 only (its wheel; elsewhere the extra installs nothing and the chapter says so).
$(VENV)/.distlab-ft-installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[ft]'
	touch $@

$(VENV)/.distlab-book-installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[book]'
	touch $@

# Chapters 04, 06, 08 in JupyterLab in headless Chromium (playwright's, or Debian's chromium), and an
# exported trace loaded by Perfetto's own UI and trace processor (tests/browser/test_perfetto.py).
test-browser: $(STAMP) $(VENV)/.distlab-browser-installed
	DISTLAB_BROWSER_TEST=1 $(PY) -m pytest tests/browser --timeout=1200 -q

$(VENV)/.distlab-browser-installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet -e '.[browser]'
	touch $@

# Re-execute notebooks in place as nbval sees them: `make regen` or `make regen NB=notebooks/03_*.ipynb`
regen: $(STAMP) $(VENV)/.distlab-hta-installed $(VENV)/.distlab-ft-installed
	$(PY) tools/regen.py $(NB)

exercises: $(STAMP)
	$(PY) -m distlab.exercises

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

# Every strategy on the GPUs (NCCL) against the CPU reference; says so and exits 0 without a GPU.
# `make gpu-check ARGS=--cpu` runs the same table on gloo with CPU ranks.
gpu-check: $(STAMP)
	$(PY) -m distlab.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) lib/*.egg-info
