# One entry point. `make demo` and `make test` set everything up first
# (a virtual environment in .venv, the C++ extension built into it).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
# Build requirements (pyproject's [build-system]); installed into the venv so
# that rebuilds after an edit take seconds, without build isolation.
BUILD_REQS := "scikit-build-core>=0.10" "nanobind>=2.4" cmake ninja jax jaxlib

.PHONY: setup vm-setup train demo test test-python test-cpp clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.build-reqs: | $(PY)
	$(PY) -m pip install -q $(BUILD_REQS)
	touch $@

setup: $(VENV)/.build-reqs
	$(PY) -m pip install -q --no-build-isolation -e ".[test,experiments]"

# The main job: a byte-level GPT trained with its state in the (emulated)
# cxl tier under a device budget smaller than the state.
train: setup
	$(PY) -m experiments.train

demo: setup
	$(PY) -m experiments.pool_bandwidth

# What tests/vm_test.py needs to boot VMs: QEMU, a kernel and the CXL tools
# (apt-get, each only when missing) and virtme-ng in .vm-venv. A failure here
# does not stop the other tests; the VM tests then fail and say why.
vm-setup:
	-VM_VENV=$(abspath .vm-venv) bash tools/vm_setup.sh

test: setup vm-setup test-cpp test-python

test-python:
	$(PY) -m pytest -q

test-cpp:
	bash tools/cpp_tests.sh

clean:
	rm -rf build
