# One command to set up and run the demo, one to set up and run the tests.
# A fresh clone needs only python3 (3.10+) and the package index.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The torch/torchvision pair this project is tested with (CUDA wheels, run on CPU too).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# Most of a test's time is spent waiting on the processes it starts (trainers, mlflow server, moto,
# torchrun), so two pytest workers share 2 cores well.
TEST_WORKERS ?= 2

.PHONY: setup demo demo-long test coverage bench clean
setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PINS)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/tracktron train --config configs/demo.yaml

demo-long: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/tracktron train --config configs/demo_long.yaml

test: $(STAMP)
	$(VENV)/bin/ruff check trainer tests bench pipeline
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

# The suite under coverage.py: the Python processes the tests start (trainers, torchrun's workers, the
# CLI, pytest's workers) are measured too ([tool.coverage.run] patch in pyproject.toml); `make coverage TESTS=tests/test_train.py`
# measures a part. The report lists trainer/'s files that have lines no test runs.
TESTS ?= tests
coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest -q -n $(TEST_WORKERS) $(TESTS)
	$(PY) -m coverage combine -q
	$(PY) -m coverage report --skip-covered --sort=cover

bench: $(STAMP)
	$(PY) -m bench.run

clean:
	rm -rf output mlflow.db mlflow.db.lock mlruns mlartifacts datasets .pytest_cache .coverage .coverage.*
