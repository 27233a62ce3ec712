# Sourced by scripts/test.sh and scripts/demo.sh (not run by itself): the Debian packages the
# local cluster's real node and the daemonless image builds need, installed with apt-get when
# one of their programs is missing (nothing is started by installing them).
#
#   install_system_packages [PACKAGE:PROGRAM ...]   (more packages, each if its program is missing)
#
# debootstrap, buildah and skopeo build the operator and worker images into the local OCI
# store; containerd, runc, the CNI plugins and iptables run the real node (dwdp dev up), and
# containerd unpacks image layers with pigz's unpigz when it is there (the worker image's 3.4 GB
# layer: 17 s against gzip's 41 s on 2 cores).

install_system_packages() {
  local packages=() pair
  # PACKAGE:PROGRAM, the program telling that the package is installed; the caller's after
  for pair in debootstrap:debootstrap buildah:buildah skopeo:skopeo \
    containerd:containerd runc:runc iptables:iptables pigz:unpigz \
    containernetworking-plugins:/usr/lib/cni/bridge "$@"; do
    command -v "${pair#*:}" >/dev/null 2>&1 || packages+=("${pair%%:*}")
  done
  if [ ${#packages[@]} -gt 0 ]; then
    printf '\n== %s\n' "installing system packages (${packages[*]})"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${packages[@]}" >/dev/null
  fi
}
