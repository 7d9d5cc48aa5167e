# One command each for a newcomer on a fresh machine with Python >= 3.10 and pip:
#   make test   create .venv, install tachyon with its test extras, run the default (CPU) suite
#   make train  create .venv, install tachyon (with the train extra: matplotlib, tokenizers), run the main job
# Both install the exact versions in constraints.txt; `make upgrade-check` moves them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test train demo install clean upgrade-check oldest-check

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	@# Pin every later pip install in this venv to constraints.txt (pip reads $$VIRTUAL_ENV/pip.conf).
	printf '[install]\nconstraint = %s/constraints.txt\n' "$(CURDIR)" > $(VENV)/pip.conf
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0 -c constraints.txt
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,triton,hf,train]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile tests

train: $(STAMP)
	$(BIN)/python -m tachyon train

demo: $(STAMP)
	$(BIN)/python -m tachyon demo

# Moving the pins: newest releases in a scratch venv (.venv-pins), the suite, and on success
# constraints.txt and src/tachyon/tested_versions.json rewritten (review with git diff).
upgrade-check:
	$(PYTHON) tools/pins.py upgrade

# The suite at the pyproject lower bounds (tested_versions.json's "oldest"); changes nothing.
oldest-check:
	$(PYTHON) tools/pins.py oldest

clean:
	rm -rf $(VENV) .venv-pins
