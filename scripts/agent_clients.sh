#!/usr/bin/env bash
# Claude Code and Codex, the coding agents tests/test_agents.py runs against a
# real offgrid: test-only dependencies, installed with npm into the cache and
# kept there ($OFFGRID_CACHE, ~/.cache/offgrid, one folder per pair of versions).
#
#   bash scripts/agent_clients.sh      # prints the folder; its bin/ has claude and codex
#
# Both ship native binaries in npm optional dependencies (claude-code-linux-x64,
# codex-linux-x64): `npm install` picks this platform's, and each must answer
# --version here before the folder is marked ready.  Claude Code's package says
# node >= 22 but runs its native binary, not node; Codex's launcher needs node >= 16.
set -euo pipefail

CLAUDE_CODE_VERSION=${CLAUDE_CODE_VERSION:-2.1.332}
CODEX_VERSION=${CODEX_VERSION:-0.171.0}
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
DIR=$CACHE/agent-clients-claude-$CLAUDE_CODE_VERSION-codex-$CODEX_VERSION

if [ -f "$DIR/.ready" ]; then
    echo "$DIR"
    exit 0
fi
command -v npm >/dev/null || { echo "agent_clients: npm is needed (apt-get install npm)" >&2; exit 1; }
mkdir -p "$DIR"
exec 9>"$DIR.lock"
flock 9                     # one install at a time (pytest workers share the cache)
if [ ! -f "$DIR/.ready" ]; then
    echo "agent_clients: installing @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION and" \
         "@openai/codex@$CODEX_VERSION into $DIR" >&2
    npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" >&2
    mkdir -p "$DIR/bin"
    ln -sf ../node_modules/.bin/claude "$DIR/bin/claude"
    ln -sf ../node_modules/.bin/codex "$DIR/bin/codex"
    # npm may leave Claude Code's postinstall (which puts the native binary in
    # place) unrun; run it if the binary does not answer
    if ! "$DIR/bin/claude" --version >/dev/null 2>&1; then
        (cd "$DIR/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2
    fi
    "$DIR/bin/claude" --version >&2
    "$DIR/bin/codex" --version >&2
    touch "$DIR/.ready"
fi
echo "$DIR"
