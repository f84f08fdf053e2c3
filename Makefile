# Two commands do all set-up on a fresh machine: `make up` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

MODEL   = .epd/models/deepseek-v41-tiny

.PHONY: install model up down status test compose-test compose-up compose-down clean

install: $(STAMP)

# Re-install whenever pyproject.toml changes. torch first, by exact version: the machine's local
# CPU wheel; a looser spec would pull a multi-GB CUDA build. NeMo Automodel is the test-only V4.1
# reference model: it pins transformers 5.18, ours is 5.24 (the V4 reference) and it runs on 5.24,
# so it goes in last without its dependencies (pillow, which it imports, is in the test extra).
# The bench extra: matplotlib, for `epd bench ... --plot`.
# xgrammar is what `epd bench grammar` measures llguidance (the stack's grammar library) against; without
# its dependencies: triton is only for its GPU kernels, which the bench does not use.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps nemo-automodel==0.7.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

# The default model: random weights in the tiny V4.1 shape, written in the released V4.1 checkpoint layout
# (FP8 / MXFP4), with our V4.1 tokenizer (the V4 vocabulary); made here, never downloaded.
model: $(MODEL)/config.json
$(MODEL)/config.json: engine/configs/tiny-v41.json engine/models/v41/random_init.py | $(STAMP)
	$(VENV)/bin/epd model init --arch v4.1 --seed 0 --out $(MODEL)

up: install model
	$(VENV)/bin/epd up

down:
	$(VENV)/bin/epd down

status:
	$(VENV)/bin/epd status

# Two pytest processes (pytest-xdist): one runs the files that start service processes (marked slow),
# one after another; the other takes the remaining files whole, and both share what is left at the end
# (tests/helpers/test_helper_xdist.py). One process alone left a 2-core machine's second core about half idle.
# TEST_WORKERS=0 runs the suite in this process, one test at a time.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The default topology in containers (compose/README.md): the image (compose/build-image picks a base
# and a BuildKit client), the stack's CURVE keys (compose/make-keys), then Compose.
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)

compose-up:
	compose/build-image
	compose/make-keys
	$(COMPOSE) -f compose/docker-compose.yml up -d

compose-down:
	$(COMPOSE) -f compose/docker-compose.yml down

# Needs a Docker engine: builds the image, then tests/compose runs the stack in containers (SDK
# requests, both replicas of scaled pools, a decode container killed mid-stream, `epd trace` over
# `compose logs`, nothing left after `down -v`). `.ci/run` calls it when dockerd can start.
compose-test: install
	compose/build-image
	compose/make-keys
	EPD_COMPOSE_TEST=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/compose

clean:
	rm -rf $(VENV) .epd *.egg-info
