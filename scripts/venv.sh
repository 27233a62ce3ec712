# Sourced by scripts/test.sh and scripts/demo.sh (not run by itself): the virtual environment
# .venv with the product and the development distribution in tools/ (editable) and every
# Python package the demo and the tests use.
#
#   install_venv    (makes .venv with $PYTHON, default python3, if it is not there; then pip)

install_venv() {
  [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
  # -qq: errors only (with -q pip warns about every release of lm-eval's pytablewriter whose
  # metadata it refuses, some 480 lines). The bytecode of the 2 GB installed is compiled after
  # pip, on every core (pip compiles on one: a fresh .venv took 167 s on 2 cores, now about
  # 136 s), and compiled up front: where PYTHONDONTWRITEBYTECODE is set (this project's CI machines set it)
  # Python never writes it, and every process of the tests would compile torch's modules again
  # (a test command so took 37 min, not 25). torch's py312_* test files are skipped:
  # their syntax is newer than Python 3.11's, and nothing imports them.
  .venv/bin/python -m pip install -qq --upgrade pip
  .venv/bin/python -m pip install -qq --no-compile -e ".[test]" -e ./tools
  .venv/bin/python -m compileall -q -j 0 -x '/py31[2-9]_[^/]*[.]py$' .venv/lib >/dev/null
}
