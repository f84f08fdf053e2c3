# Two commands do all set-up on a fresh machine: `make up` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: install up down status test clean

install: $(STAMP)

# Re-install whenever pyproject.toml changes. torch first, by exact version: the machine's local
# CPU wheel; a looser spec would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

up: install
	$(VENV)/bin/epd up

down:
	$(VENV)/bin/epd down

status:
	$(VENV)/bin/epd status

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .epd *.egg-info
