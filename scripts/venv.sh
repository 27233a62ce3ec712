# Sourced by scripts/test.sh and scripts/demo.sh (not run by itself): the virtual environment
# .venv with the product and the development distribution in tools/ (editable) and every
# Python package the demo and the tests use.
#
#   install_venv    (makes .venv with $PYTHON, default python3, if it is not there; then pip)

install_venv() {
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # -qq: errors only (with -q pip warns about every release of lm-eval's pytablewriter whose
  # metadata it refuses, some 480 lines). --no-compile: no bytecode for the 2 GB installed up
  # front (a fresh .venv in 97 s, not 167 s, on 2 cores with pip's cache warm); Python writes
  # it for the modules it imports, when it first imports them.
  .venv/bin/python -m pip install -qq --upgrade pip
  .venv/bin/python -m pip install -qq --no-compile -e ".[test]" -e ./tools
}
