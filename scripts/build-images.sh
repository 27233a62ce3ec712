#!/usr/bin/env bash
# Build (and optionally push) the dwdp images from this repository:
#   dwdp-operator  images/operator/Dockerfile  `dwdp operator` (the chart's image)
#   dwdp-worker    images/worker/Dockerfile    `dwdp launch` with torch (CUDA), NIXL, MPI
#   dwdp-router    images/router/Dockerfile    vllm-router (PD disaggregation)
#
#   scripts/build-images.sh [--push] [--only NAME]... [--dry-run] [--refresh-constraints]
#   scripts/build-images.sh --local [--only NAME]...
#
# --local: no engine or daemon; `dwdp dev images` builds a debootstrap Debian base (umoci) and
# the images on it with buildah (vfs, chroot isolation) into the local OCI store
# ~/.cache/dwdp/images (what the local cluster's process kubelet runs pods from), cached by a
# hash of the inputs; needs root, debootstrap, buildah, skopeo and Go (it builds umoci 0.6)
# (default: operator).
# Push one with: skopeo copy oci:<layout>:<tag> docker://REGISTRY/dwdp-NAME:TAG (the layout is
# printed).
#
# Environment: REGISTRY (default ghcr.io/dwdp; the images are REGISTRY/NAME:TAG), TAG
# (default: the package version, dwdp.__version__, which is also the chart's appVersion),
# ENGINE (docker, podman or buildah; default: the first that works), PLATFORM (default
# linux/amd64: the CUDA wheels are x86_64), SOURCE (the OCI source label; default the git
# remote), BUILD_OPTS (more words for the build command, e.g. "--build-arg
# PYTHON_IMAGE=python:3.12.11-slim-bookworm@sha256:..." or buildah's "-v" mounts). Buildah in
# a container without overlayfs or user namespaces: STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot.
# Labels: org.opencontainers.image.version (the version), .revision (git commit, "-dirty"
# with uncommitted changes), .source, .created.
# --dry-run prints the commands instead of running them (needs no engine);
# --refresh-constraints rewrites images/constraints.txt from the tested .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL=(operator worker router)
push=0 dry=0 refresh=0 local=0 only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=1 ;;
    --local) local=1 ;;
    --dry-run) dry=1 ;;
    --refresh-constraints) refresh=1 ;;
    --only) shift; only+=("${1:?--only needs a name: ${ALL[*]}}") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#only[@]} -gt 0 ] || { if [ "$local" = 1 ]; then only=(operator); else only=("${ALL[@]}"); fi; }
for name in "${only[@]}"; do
  [ -f "images/$name/Dockerfile" ] || { echo "build-images: no image $name (${ALL[*]})" >&2; exit 2; }
done

run() {
  if [ "$dry" = 1 ]; then printf '%q ' "$@"; printf '\n'; else "$@"; fi
}

if [ "$local" = 1 ]; then
  words=()
  for name in "${only[@]}"; do words+=(--only "$name"); done
  dwdp=dwdp
  [ -x .venv/bin/dwdp ] && dwdp=.venv/bin/dwdp
  run "$dwdp" dev images "${words[@]}"
  exit 0
fi

if [ "$refresh" = 1 ]; then
  [ -x .venv/bin/pip ] || { echo "build-images: no .venv (scripts/test.sh makes it)" >&2; exit 1; }
  {
    grep '^#' images/constraints.txt
    .venv/bin/pip freeze --all --exclude-editable | grep -v '^#'
  } > images/constraints.txt.new
  mv images/constraints.txt.new images/constraints.txt
  echo "build-images: images/constraints.txt refreshed from .venv"
fi

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' src/dwdp/__init__.py)
[ -n "$version" ] || { echo "build-images: no __version__ in src/dwdp/__init__.py" >&2; exit 1; }
tag=${TAG:-$version}
registry=${REGISTRY:-ghcr.io/dwdp}
platform=${PLATFORM:-linux/amd64}
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  revision="$revision-dirty"
fi
source=${SOURCE:-$(git config --get remote.origin.url 2>/dev/null || echo https://github.com/dwdp/dwdp)}
created=$(date -u +%Y-%m-%dT%H:%M:%SZ)

engine=${ENGINE:-}
if [ -z "$engine" ]; then
  for candidate in docker podman buildah; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if [ "$candidate" = docker ] && ! docker info >/dev/null 2>&1; then continue; fi
    engine=$candidate
    break
  done
fi
if [ -z "$engine" ]; then
  if [ "$dry" = 1 ]; then engine=docker; else
    echo "build-images: no docker (with a running daemon), podman or buildah found; set ENGINE" >&2
    exit 1
  fi
fi
case "$engine" in
  docker|podman) build=("$engine" build) ;;
  buildah) build=(buildah build --layers) ;;
  *) echo "build-images: ENGINE must be docker, podman or buildah, not $engine" >&2; exit 2 ;;
esac

for name in "${only[@]}"; do
  image="$registry/dwdp-$name:$tag"
  echo "== $image ($engine, $platform, revision $revision)" >&2
  start=$(date +%s)
  run "${build[@]}" \
    --platform "$platform" \
    --file "images/$name/Dockerfile" \
    --tag "$image" \
    --build-arg "VERSION=$version" \
    --build-arg "REVISION=$revision" \
    --build-arg "SOURCE=$source" \
    --build-arg "CREATED=$created" \
    ${BUILD_OPTS:-} \
    .
  [ "$dry" = 1 ] || echo "   built in $(( $(date +%s) - start )) s" >&2
  if [ "$push" = 1 ]; then
    run "$engine" push "$image"
  fi
done
