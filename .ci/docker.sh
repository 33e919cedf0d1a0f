#!/usr/bin/env bash
# A Docker engine and Compose v2 on this CI machine (Debian bookworm, root, no registry):
#   - Debian's docker.io (Engine 20.10) and debootstrap (for the stand-in base image, .ci/base_image.sh);
#   - dockerd started here unless one answers already (log: $DOCKERD_LOG);
#   - Compose v2: not in bookworm, so trixie's docker-compose package (a Go binary) is downloaded with a private
#     apt state (the system's sources stay bookworm) and its plugin put under ~/.docker/cli-plugins/.
# Bookworm's own docker-compose (1.29) cannot read the `!reset` of docker-compose.cpu.yml.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
: "${DOCKERD_LOG:=/tmp/dockerd.log}"
COMPOSE_VERSION=2.26.1

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq docker.io debootstrap >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  nohup dockerd >"$DOCKERD_LOG" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null || { tail -20 "$DOCKERD_LOG"; exit 1; }
fi

plugin="$HOME/.docker/cli-plugins/docker-compose"
if ! docker compose version 2>/dev/null | grep -q " v\?$COMPOSE_VERSION"; then
  state="$(mktemp -d)"
  trap 'rm -rf "$state"' EXIT
  mkdir -p "$state/lists/partial" "$state/archives/partial" "$state/sources.list.d"
  echo "deb http://deb.debian.org/debian trixie main" >"$state/sources.list"
  apt_options=(
    -o Dir::State="$state" -o Dir::State::status=/var/lib/dpkg/status -o Dir::Cache="$state"
    -o Dir::Etc::SourceList="$state/sources.list" -o Dir::Etc::SourceParts="$state/sources.list.d"
    -o APT::Sandbox::User=root
  )
  apt-get "${apt_options[@]}" update -qq
  (cd "$state" && apt-get "${apt_options[@]}" download "docker-compose=$COMPOSE_VERSION*")
  dpkg -x "$state"/docker-compose_*.deb "$state/root"
  mkdir -p "$(dirname "$plugin")"
  install -m 0755 "$state/root/usr/libexec/docker/cli-plugins/docker-compose" "$plugin"
fi
docker version --format 'Docker Engine {{.Server.Version}}'
docker compose version
