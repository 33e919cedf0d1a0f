# cookiecutter-triton-bls: `make help` lists the targets.
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo/image-classifier

help: ## list the targets (coloured on a terminal only; NO_COLOR=1 turns colour off)
	@c=; r=; if [ -t 1 ] && [ -z "$$NO_COLOR" ]; then c=$$(printf '\033[36m'); r=$$(printf '\033[0m'); fi; \
	grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' -v c="$$c" -v r="$$r" \
	  '{ n[NR] = $$1; d[NR] = $$2; if (length($$1) > w) w = length($$1) } \
	   END { for (i = 1; i <= NR; i++) printf "  %s%-" w "s%s  %s\n", c, n[i], r, d[i] }'

# Python 3.11 or 3.12: the tests read TOML with tomllib (3.11), and numpy<2 (the generated project's Triton
# Python-backend stub needs it) has no wheel for 3.13, where pip would build it from source for minutes.
CHECK_PYTHON := import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v < (3, 13) else \
	"error: the template tests and make demo need Python 3.11 or 3.12, and $(PYTHON) is %d.%d (numpy<2 has no " \
	"wheel for 3.13; tomllib needs 3.11). Choose another Python: make demo PYTHON=python3.12" % v)

$(BIN)/activate: requirements.txt
	@$(PYTHON) -c '$(CHECK_PYTHON)'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --progress-bar off --upgrade pip
	@echo "Installing the template's tools and the generated project's runtime: torch and torchvision with their CUDA"\
	" libraries (about 2.9 GB to download, a 6.0 GB .venv; minutes), nvidia-pytriton (tritonserver), kubectl, ...:"
	$(BIN)/pip install -r requirements.txt
	touch $@

demo: $(BIN)/activate ## bake the default project into build/demo, write random weights, serve it on the local Triton, classify
	rm -rf $(DEMO)
	$(BIN)/cookiecutter --no-input --output-dir $(dir $(DEMO)) .
	$(BIN)/pip install -q --no-deps --no-build-isolation -e $(DEMO)  # no downloads: quick
	cd $(DEMO) && PATH=$(CURDIR)/$(BIN):$$PATH image-classifier weights random
	cd $(DEMO) && PATH=$(CURDIR)/$(BIN):$$PATH python scripts/demo.py

test: $(BIN)/activate ## template tests: bakes, hooks, configs, and the baked project's suite against a real Triton
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest

clean: ## remove .venv and build/
	rm -rf $(VENV) build .pytest_cache

.PHONY: help demo test clean
