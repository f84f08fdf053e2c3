# Two commands do all set-up on a fresh machine: `make up` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

MODEL   = .epd/models/deepseek-v4-tiny

.PHONY: install model up down status test clean

install: $(STAMP)

# Re-install whenever pyproject.toml changes. torch first, by exact version: the machine's local
# CPU wheel; a looser spec would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# The default model: random weights in the tiny V4 shape, the real V4 tokenizer; made here, never downloaded.
model: $(MODEL)/config.json
$(MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/epd model init --config tiny --seed 0 --out $(MODEL)

up: install model
	$(VENV)/bin/epd up

down:
	$(VENV)/bin/epd down

status:
	$(VENV)/bin/epd status

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .epd *.egg-info
