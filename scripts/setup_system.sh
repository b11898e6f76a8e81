#!/usr/bin/env bash
# Installs the Debian packages tenplex needs when they are missing and we are root; otherwise says
# what is missing and carries on: fuse3 for the dataset VFS, etcd-server for the replicated
# membership store (docs/store.md: no single point of failure).
set -u
missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3 libfuse3-3)
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian packages ${missing[*]}" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
        >/dev/null 2>&1 || echo "setup: could not install ${missing[*]}; FUSE / etcd features will be skipped" >&2
else
    echo "setup: missing Debian packages ${missing[*]} (fuse3: the dataset VFS; etcd-server: the replicated" \
         "membership store); install them to use those features" >&2
fi
exit 0
