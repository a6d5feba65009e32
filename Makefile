# The two commands of the README:
#   make demo   - set everything up and run the end-to-end demo on the embedded default
#   make test   - set everything up and run the whole test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock

.PHONY: demo test setup lock infra test-infra lint bench schemas clean

# The environment is exactly requirements.lock (every package pinned, with its hashes: what CI tested), plus the
# project itself. A changed lock rebuilds the environment from scratch, so nothing the lock dropped lingers.
# The build backend (setuptools) comes from the lock too: no build isolation, nothing installed unhashed.
$(STAMP): $(LOCK) pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	@# A cold machine spends a minute or more here: pip names each package as it fetches it (no
	@# progress bars, which a piped log would show as noise).
	@echo "setup: installing the $$(grep -c '^[a-z0-9]' $(LOCK)) Python packages of $(LOCK) into $(VENV) ..."
	$(PY) -m pip install --progress-bar off --disable-pip-version-check --require-hashes -r $(LOCK)
	@# setuptools' note about editable installs is a warning for package authors, not a newcomer's business.
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# An installed image has its modules compiled (`pip install .` writes their .pyc files); this checkout, run with
# PYTHONDONTWRITEBYTECODE, compiled ~80 of them from source at every process start: ~0.1 s of CPU before a
# restarted worker or actuator reads again (xidflow bench, failover_*_process). Up-to-date files are skipped; a
# module edited since is compiled in memory as before.
setup: $(STAMP)
	$(PY) -m compileall -q pipeline schemas agents

# Re-resolves requirements.lock from pyproject.toml (its dependencies, the test extra and the build backend),
# keeping every pin that still fits. `make lock UPGRADE="faust-streaming aiokafka"` moves those to their newest
# versions within pyproject.toml's ranges, `make lock UPGRADE=all` everything; README, "Upgrading dependencies".
BUILD_REQUIRES := $(PYTHON) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'], sep='\n')"
UPGRADE ?=
# The result replaces the lock only when it differs: an unchanged lock does not rebuild the environment.
lock: setup
	cp $(LOCK) $(LOCK).new
	$(BUILD_REQUIRES) | $(VENV)/bin/uv pip compile --quiet pyproject.toml - --extra test --universal \
		--generate-hashes --custom-compile-command 'make lock' --output-file $(LOCK).new \
		$(if $(filter all,$(UPGRADE)),--upgrade,$(addprefix --upgrade-package=,$(UPGRADE)))
	if cmp -s $(LOCK).new $(LOCK); then rm $(LOCK).new; echo "$(LOCK) unchanged"; else mv $(LOCK).new $(LOCK); fi

# Builds/downloads kube-apiserver, etcd, Loki, Fluent Bit (vendored source), helm and the Kafka jars once, cached
# under ~/.cache/xidflow: what the demo runs.
infra: setup
	$(VENV)/bin/xidflow local install --loki --fluent-bit --helm

# What the tests need besides: the OpenTelemetry Collector (built from Go modules, cached), Debian's rsyslog +
# omkafka (the rsyslog shipper tests) and promtool (package prometheus; the alerting-rule tests), installed when
# missing (root + apt-get), else one sentence naming them.
test-infra: infra
	$(VENV)/bin/xidflow local install --no-loki --rsyslog --promtool --otelcol

# When `make demo` began (read as make starts), so the demo's last line gives the set-up and the total a newcomer
# waits: minutes on a cold machine (the builds), seconds after.
DEMO_STARTED := $(shell date +%s)
demo: infra
	$(VENV)/bin/xidflow demo --setup-started $(DEMO_STARTED)

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
