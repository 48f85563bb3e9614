#!/usr/bin/env bash
# The Node `openai` package, the JavaScript SDK most Node agents call a server
# through: a test-only dependency of tests/test_agent_followups.py (its Node
# follow-up), installed with npm into the cache and kept there ($OFFGRID_CACHE,
# ~/.cache/offgrid, one folder per version).
#
#   bash scripts/node_openai.sh        # prints the folder; its node_modules/ has openai
#
# The package is plain JavaScript with no dependencies; it needs node >= 18
# (global fetch), which the folder's check runs before marking it ready.
set -euo pipefail

OPENAI_NODE_VERSION=${OPENAI_NODE_VERSION:-6.49.0}
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
DIR=$CACHE/node-openai-$OPENAI_NODE_VERSION

if [ -f "$DIR/.ready" ]; then
    echo "$DIR"
    exit 0
fi
command -v npm >/dev/null || { echo "node_openai: npm is needed (apt-get install npm)" >&2; exit 1; }
mkdir -p "$DIR"
exec 9>"$DIR.lock"
flock 9                     # one install at a time (pytest workers share the cache)
if [ ! -f "$DIR/.ready" ]; then
    echo "node_openai: installing openai@$OPENAI_NODE_VERSION into $DIR" >&2
    npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error \
        "openai@$OPENAI_NODE_VERSION" >&2
    (cd "$DIR" && node -e 'const { OpenAI } = require("openai"); new OpenAI({ apiKey: "x" });') >&2
    touch "$DIR/.ready"
fi
echo "$DIR"
