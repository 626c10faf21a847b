# tessera: `make demo` sets everything up and shows the cluster working; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml services/pyproject.toml services/setup.py | cksum | cut -d' ' -f1)
SUDO   := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: setup deploy-tools models up demo lint test proto bench clean

$(STAMP): pyproject.toml services/pyproject.toml services/setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# Both distributions: tessera (client, CLI, stubs: pyproject.toml) and tessera-server (services/,
	# with torch pinned: the CPU build from this machine's disk; the rest from PyPI).
	$(BIN)/python -m pip install --quiet -e . -e './services[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# Debian's docker-compose checks deploy/docker-compose.yml (tests/deploy, so only `make test` needs it);
# installed only when missing, without its recommended Docker engine. kubectl comes with this machine's image (tests/deploy says so).
deploy-tools:
	@command -v docker-compose >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null; }

models: setup
	$(BIN)/tessera models prepare --quantized

up: models
	$(BIN)/tessera up

demo: models
	$(BIN)/tessera demo

lint: setup
	$(BIN)/ruff check tessera services tests bench docs

test: models lint deploy-tools
	$(BIN)/python -m pytest -q

proto: setup
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. protos/tessera/v1/*.proto

clean:
	rm -rf $(VENV) build *.egg-info services/build services/*.egg-info
