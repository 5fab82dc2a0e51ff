# Set-up and entry points. Each target installs what it needs: CPU torch 2.13.0 first (pinned, so no
# CUDA build is pulled in), then this package with its test extras.
PYTHON ?= python3

.PHONY: install demo test

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[test]"

demo: install
	$(PYTHON) examples/quick_tour.py

test: install
	$(PYTHON) -m ruff check src tests examples
	$(PYTHON) -m pytest
