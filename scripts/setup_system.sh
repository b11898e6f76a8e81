#!/usr/bin/env bash
# Installs the Debian packages tenplex needs (fuse3 for the dataset VFS) when they are
# missing and we are root; otherwise says what is missing and carries on.
set -u
if command -v fusermount3 >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian packages fuse3 libfuse3-3" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse3 libfuse3-3) >/dev/null 2>&1 \
        || echo "setup: could not install fuse3; FUSE features will be skipped" >&2
else
    echo "setup: fuse3 is missing (install the Debian package fuse3 to use the dataset VFS)" >&2
fi
exit 0
