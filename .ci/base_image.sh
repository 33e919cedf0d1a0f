#!/usr/bin/env bash
# A stand-in for `python:3.11-slim-bookworm`, for a machine that cannot pull images (no registry here):
# Debian bookworm from debootstrap with Debian's python3.11, pip and libpython (the Python-backend stub links it),
# no EXTERNALLY-MANAGED marker (the image's root pip installs system-wide, as in the official image), and this
# host's CA bundle, so that pip inside `docker build` trusts this network's certificates.
# Tagged with the official name, so the generated Dockerfile builds unchanged. Skipped if the tag exists.
set -euo pipefail
tag="${BASE_IMAGE:-python:3.11-slim-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag: already here"
  exit 0
fi
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3.11,python3-pip,python-is-python3,libpython3.11,ca-certificates \
  bookworm "$root" "$mirror"
rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' \
  - "$tag"
docker image ls "$tag"
