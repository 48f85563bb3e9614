#!/usr/bin/env bash
# scripts/venv.sh VENV PYTHON REQUIREMENT...: the tests' virtualenv, made once
# per machine in $OFFGRID_CACHE and linked from the checkout as VENV.
#
# pip takes ~30 s of a CPU to resolve and install the test-only packages, and
# every fresh clone's `make test` paid it before its first test.  The cache
# keeps one virtualenv per Python and requirement list (the key: the
# interpreter's version and path, and the requirements as given), as it keeps
# lib/'s builds and the models; the packages are those the registries gave when
# it was made.  A changed list makes another; `make clean` removes only the
# link; delete the cache's venv-* folders to take newer releases.
set -euo pipefail
venv=$1 python=$2
shift 2
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
key=$({ "$python" -c 'import sys; print(sys.version); print(sys.executable)'
        printf '%s\n' "$@"; } | sha256sum | cut -c1-12)
dir=$CACHE/venv-$key
mkdir -p "$CACHE"
if [ ! -f "$dir/.complete" ]; then
    exec 9>"$dir.lock"
    command -v flock >/dev/null && flock 9
fi
if [ ! -f "$dir/.complete" ]; then
    echo "[make venv] installing the test-only packages into $dir" >&2
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
    touch "$dir/.complete"
fi
# a folder left by an older Makefile, or a link to another key's
if [ -e "$venv" ] && [ ! -L "$venv" ]; then
    rm -rf "$venv"
fi
ln -sfn "$dir" "$venv"
