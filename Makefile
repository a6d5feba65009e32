# The two commands of the README:
#   make demo   - set everything up and run the end-to-end demo on the embedded default
#   make test   - set everything up and run the whole test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test setup infra test-infra lint bench schemas clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	@# setuptools' note about editable installs is a warning for package authors, not a newcomer's business.
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Builds/downloads kube-apiserver, etcd, Loki, Fluent Bit (vendored source), helm and the Kafka jars once, cached
# under ~/.cache/xidflow: what the demo runs.
infra: setup
	$(VENV)/bin/xidflow local install --loki --fluent-bit --helm

# What the tests need besides: the OpenTelemetry Collector (built from Go modules, cached), Debian's rsyslog +
# omkafka (the rsyslog shipper tests) and promtool (package prometheus; the alerting-rule tests), installed when
# missing (root + apt-get), else one sentence naming them.
test-infra: infra
	$(VENV)/bin/xidflow local install --no-loki --rsyslog --promtool --otelcol

demo: infra
	$(VENV)/bin/xidflow demo

lint: setup
	$(VENV)/bin/ruff check .

test: test-infra lint
	@$(PY) -m pytest -ra --durations=15 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench: infra
	$(VENV)/bin/xidflow bench --json bench-results/bench.json

schemas: setup
	$(PY) -m schemas.generate

clean:
	-$(VENV)/bin/xidflow local down
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
