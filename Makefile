# The two commands of the README. Both create .venv and install zeroflax on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-slow setup clean

$(BIN)/zeroflax: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

setup: $(BIN)/zeroflax

# The main job: a tiny GPT trained with ZeRO-3 on 8 simulated CPU devices (about 4 minutes on 2 cores).
# --resume: a second `make run` continues (or just re-reports) the run in runs/ instead of erasing it.
run: setup
	$(BIN)/zeroflax train --gin_file experiments/gpt_tiny_zero3.gin --resume

# The test suite (19 to 28 minutes on 2 cores, by CPU), without the tests marked slow (multi-process and
# end-to-end runs: `make test-slow`, about 10 minutes; CI runs both). pytest's exit code 5 (no tests collected)
# is a failure.
# PYTEST_ARGS adds pytest options, e.g. make test PYTEST_ARGS=--durations=30
test: setup
	$(BIN)/python -m pytest -n 2 -q -m "not slow" $(PYTEST_ARGS) tests

test-slow: setup
	$(BIN)/python -m pytest -n 2 -q -m slow $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) runs *.egg-info
