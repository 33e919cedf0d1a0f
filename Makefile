# cookiecutter-triton-bls: `make help` lists the targets.
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := build/demo/image-classifier

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[36m%-8s\033[0m %s\n", $$1, $$2}'

$(BIN)/activate: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	touch $@

demo: $(BIN)/activate ## bake the default project into build/demo, write random weights, serve it on the local Triton, classify
	rm -rf $(DEMO)
	$(BIN)/cookiecutter --no-input --output-dir $(dir $(DEMO)) .
	$(BIN)/pip install -q --no-deps --no-build-isolation -e $(DEMO)
	cd $(DEMO) && PATH=$(CURDIR)/$(BIN):$$PATH image-classifier weights random
	cd $(DEMO) && PATH=$(CURDIR)/$(BIN):$$PATH python scripts/demo.py

test: $(BIN)/activate ## template tests: bakes, hooks, configs, and the baked project's suite against a real Triton
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest

clean: ## remove .venv and build/
	rm -rf $(VENV) build .pytest_cache

.PHONY: help demo test clean
