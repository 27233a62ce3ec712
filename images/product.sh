# The product stage of the operator and worker images (images/*/Dockerfile): builds the dwdp
# wheel from /src (pyproject.toml and src/, the working folder) with the build tools' venv
# /opt/build, installs it alone (--no-deps) into a fresh venv /opt/dwdp on this Python (the
# interpreter the runtime's /opt/dwdp names), compiles it, and stages its files (the package,
# its metadata and the `dwdp` command) in /product, the final image's last layer.
set -eu
python3 -m venv /opt/build
/opt/build/bin/pip install pip setuptools
python3 -m venv --without-pip /opt/dwdp
/opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .
/opt/build/bin/pip --python /opt/dwdp/bin/python install --no-deps --no-compile /wheels/dwdp-*.whl
site="$(/opt/dwdp/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
/opt/dwdp/bin/python -m compileall -q "$site/dwdp"
mkdir /product
cd /
cp -a --parents opt/dwdp/bin/dwdp "${site#/}/dwdp" "${site#/}"/dwdp-*.dist-info /product/
