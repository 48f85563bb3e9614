#!/usr/bin/env python3
"""``make conformance``: llama-server's own test suite against llama-server and against offgrid.

For each chosen ``unit/test_*.py`` of the pinned suite (copied and patched by
suite.py), pytest runs twice: once with the real llama-server (from
``scripts/build_lib.sh --server``) and once with offgrid behind launcher.py,
which takes llama-server's command line.  Each run leaves JUnit XML and a log
of the servers it started in ``tests/conformance/results/TARGET/``; the table
is rebuilt from whatever XML is there, so files can be run one at a time
(``--only``, ``--target``) and the table still covers them all.

    pass llama   tests that pass on llama-server
    pass offgrid tests that pass on offgrid
    gaps         pass on llama-server, fail on offgrid, and no reason is listed:
                 offgrid's work to do
    listed       would be gaps, but ``deliberate.txt`` lists them with the reason,
                 under its kind: differences on purpose (docs/compatibility.md),
                 features not built yet, ...
    both fail    fail on both (mostly tests that assert the words of the suite's
                 toy models, which our registry models do not say)

Under the per-file table a second one gives every test that passes on
llama-server and fails on offgrid by cause: each reason of deliberate.txt
with its kind, and the gaps with no reason.

Tests marked ``slow`` are left out unless ``--slow`` is given, as llama.cpp's
own ``tools/server/tests/tests.sh`` leaves them out unless ``SLOW_TESTS=1``
(most of test_tool_call: 196 of its 202 tests load a "real" model and ask it
for a tool call, ~20 s each here); the table says which way each file ran.

The table goes to ``results/table.md``, the gaps with their first failure line
to ``results/gaps.md``, everything to ``results/summary.json``; the terminal
gets the table.  Usage:

    tests/conformance/run.py                      the default files, both servers
    tests/conformance/run.py --slow --only tool_call -k Qwen   slow tests too
    tests/conformance/run.py --only infill,tokenize --target offgrid
    tests/conformance/run.py --all                the other issues' files too
    tests/conformance/run.py --table              rebuild the table, run nothing
"""

import argparse
import fnmatch
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
DELIBERATE = HERE / "deliberate.txt"
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))    # tests/: its helpers, written once
import launcher  # noqa: E402
import suite  # noqa: E402
from serverproc import free_port  # noqa: E402

# The files run by default: the ones offgrid means to match (issue 15's eleven).
CORE = ["basic", "tokenize", "security", "infill", "completion", "chat_completion", "stream",
        "tool_call", "template", "ctx_shift", "metrics"]
# The files of endpoints other issues add: listed in the table, run with --all or --only.
OTHERS = ["embedding", "rerank", "compat_anthropic", "compat_oai_responses", "router", "sleep",
          "speculative", "slot_save"]
TARGETS = ["llama-server", "offgrid"]

# The suite's test-only packages (its requirements.txt), by import name; versions
# are left to pip so the project's own pytest and openai are not downgraded.
PACKAGES = {"aiohttp": "aiohttp", "pytest": "pytest", "requests": "requests",
            "prometheus_client": "prometheus-client", "wget": "wget", "openai": "openai",
            "numpy": "numpy", "filelock": "filelock"}


def ensure_packages(python):
    """Install whatever of PACKAGES ``python`` cannot import (idempotent: none, nothing runs)."""
    missing = []
    for module, package in PACKAGES.items():
        if subprocess.run([python, "-c", "import " + module], capture_output=True).returncode:
            missing.append(package)
    if missing:
        print("conformance: installing %s" % " ".join(missing), flush=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
                       + missing, check=True)


def llama_server():
    """The pinned llama-server binary (built once by scripts/build_lib.sh --server)."""
    out = subprocess.run(["nice", "-n", "10", "bash", str(ROOT / "scripts" / "build_lib.sh"),
                          "--server"], cwd=str(ROOT), stdout=subprocess.PIPE, check=True,
                         text=True).stdout.strip().splitlines()
    return str(Path(out[-1]) / "llama-server")


@functools.lru_cache(maxsize=None)
def offgrid_flags():
    return " ".join(launcher.offgrid_flag_names())


def suite_env(target, log, binary=None):
    """The environment of the suite's pytest: which server its ServerProcess starts."""
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(HERE / "launcher.py"),
               CONFORMANCE_TARGET=target, CONFORMANCE_LOG_FILE=str(log),
               OFFGRID_CONFORMANCE_MODELS=str(ROOT / "models"), PORT=str(free_port()),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    if target == "offgrid":
        # the flags this checkout's offgrid has, read once here rather than by
        # a `python -m offgrid --help` at each of the suite's server starts
        env["OFFGRID_CONFORMANCE_FLAGS"] = offgrid_flags()
    if binary:
        env["CONFORMANCE_LLAMA_SERVER"] = binary
    return env


def load_average():
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_file(name, target, tests_dir, python, binary, timeout, k=None, slow=False):
    """pytest on unit/test_NAME.py with TARGET behind the launcher; (rc, seconds).

    Without ``slow``, tests marked slow are deselected (``-m "not slow"``) and the
    suite's own ``is_slow_test_allowed()`` says no, as tests.sh does by default."""
    out = RESULTS / target
    out.mkdir(parents=True, exist_ok=True)
    xml, log = out / ("test_%s.xml" % name), out / ("test_%s.launches.jsonl" % name)
    for path in (xml, log):
        if path.exists():
            path.unlink()
    env = suite_env(target, log, binary)
    env.pop("SLOW_TESTS", None)
    if slow:
        env["SLOW_TESTS"] = "1"
    cmd = [python, "-m", "pytest", "unit/test_%s.py" % name, "-q", "-p", "no:cacheprovider",
           "--junitxml", str(xml), "-o", "junit_family=xunit1"] + (["-k", k] if k else [])
    if not slow:
        cmd += ["-m", "not slow"]
    print("conformance: %s on %s" % ("test_%s.py" % name, target), flush=True)
    start, load = time.monotonic(), load_average()
    with open(out / ("test_%s.log" % name), "w") as fh:
        proc = subprocess.Popen(cmd, cwd=str(tests_dir), env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Ctrl-C first: pytest stops, its fixtures stop the server, and the
            # JUnit XML keeps the tests that ran; then whatever is left
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    took = time.monotonic() - start
    # what the table says of the run: the machine's load before and after, mode, when
    record = {"rc": rc, "seconds": round(took), "slow": slow,
              "load": [round(load, 1), round(load_average(), 1)],
              "deselected": deselected(out / ("test_%s.log" % name)), "k": k,
              "commit": commit(), "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / ("test_%s.rc" % name)).write_text(json.dumps(record) + "\n")
    return rc, took


def commit():
    """The checkout's commit, with "+" if it has changes git tracks; "?" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT),
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=str(ROOT)).returncode
    except OSError:
        return "?"
    return (head + ("+" if dirty else "")) if head else "?"


def deselected(log):
    """How many tests pytest's summary line says it deselected (the slow ones)."""
    try:
        tail = log.read_text(errors="replace").splitlines()[-3:]
    except OSError:
        return 0
    found = [re.search(r"(\d+) deselected", line) for line in tail]
    return next((int(m.group(1)) for m in reversed(found) if m), 0)


def run_info(target, name):
    """The .rc record of a file's last run (older runs wrote "RC SECONDS"); None if none."""
    path = RESULTS / target / ("test_%s.rc" % name)
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return json.loads(text)
    except ValueError:
        rc, _, took = text.partition(" ")
        return {"rc": rc, "seconds": float(took or 0), "slow": None, "load": [], "deselected": 0}


# -- reading results ----------------------------------------------------------------

def outcomes(target, name):
    """{test id: ("pass"|"fail"|"skip", first line of the failure)} from a file's XML; None if none."""
    xml = RESULTS / target / ("test_%s.xml" % name)
    if not xml.is_file():
        return None
    found = {}
    for case in ET.parse(xml).iter("testcase"):
        test = case.get("name")
        if not test:
            continue        # an interrupted run's placeholder
        outcome, why = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "fail"
                why = (child.get("message") or child.text or "").strip().splitlines()
                why = why[0][:200] if why else ""
                break
            if child.tag == "skipped":
                outcome = "skip"
        found[test] = (outcome, why)
    return found


def launches(target, name):
    path = RESULTS / target / ("test_%s.launches.jsonl" % name)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# the kind of deliberate.txt's entries before its first [heading]
DEFAULT_KIND = "on purpose"
GAP = "gap"         # the kind of a test no entry explains
STALE = "unused"    # the kind of the entries that explained nothing in the files run


def deliberate():
    """[(fnmatch pattern of "test_FILE.py::TEST", reason, kind)] from deliberate.txt.

    A line ``[KIND]`` (no "::") starts the entries of that kind ("on purpose",
    "not built yet", ...); a pattern line is ``PATTERN  # reason``."""
    out, kind = [], DEFAULT_KIND
    for line in DELIBERATE.read_text().splitlines() if DELIBERATE.is_file() else []:
        pattern, _, why = line.partition("#")
        pattern = pattern.strip()
        if not pattern:
            continue
        if pattern.startswith("[") and pattern.endswith("]") and "::" not in pattern:
            kind = pattern[1:-1].strip()
            continue
        out.append((pattern, why.strip(), kind))
    return out


def by_design(file, test, patterns):
    """(reason, kind) of the first entry that matches ``file::test``, or None."""
    return next(((why, kind) for pattern, why, kind in patterns
                 if fnmatch.fnmatchcase("%s::%s" % (file, test), pattern)), None)


def summarize(names):
    """(per-file rows, {file: [(gap, first failure line)]}, dropped flags, flags left
    aside on purpose, by-cause rows)."""
    rows, gaps, dropped, on_purpose = [], {}, defaultdict(set), defaultdict(set)
    causes = defaultdict(list)      # (kind, reason) -> [(file, test)]
    patterns = deliberate()
    used, ran = set(), set()        # patterns that explained a gap; files run on both
    for name in names:
        got = {t: outcomes(t, name) for t in TARGETS}
        for record in launches("offgrid", name):
            for flag in record.get("dropped", []):
                dropped[flag].add(record.get("test") or name)
            for flag in record.get("on_purpose", []):
                on_purpose[flag].add(record.get("test") or name)
        file = "test_%s.py" % name
        info = {t: run_info(t, name) for t in TARGETS}
        row = {"name": file, "file": file, "runs": {t: i for t, i in info.items() if i}}
        notes = []
        timed_out = [t for t in TARGETS if info[t] and info[t]["rc"] == "timeout"]
        if timed_out:
            notes.append("timed out on %s" % ", ".join(timed_out))
        if any(i and i["slow"] for i in info.values()):
            notes.append("slow tests run" if all(i is None or i["slow"] for i in info.values())
                         else "slow tests run on %s only" % ", ".join(
                             t for t in TARGETS if info[t] and info[t]["slow"]))
        left_out = max((i["deselected"] for i in info.values() if i), default=0)
        if left_out:
            notes.append("%d slow left out" % left_out)
        if notes:
            row["file"] += " (%s)" % "; ".join(notes)
        if got["llama-server"] is None and got["offgrid"] is None:
            rows.append(dict(row, run=False))
            continue
        ids = sorted(set().union(*(g.keys() for g in got.values() if g)))
        get = {t: (lambda i, g=got[t]: g.get(i, ("-", ""))[0] if g is not None else "-")
               for t in TARGETS}
        row.update(run=True, tests=len(ids),
                   llama=sum(get["llama-server"](i) == "pass" for i in ids)
                   if got["llama-server"] is not None else None,
                   offgrid=sum(get["offgrid"](i) == "pass" for i in ids)
                   if got["offgrid"] is not None else None,
                   skipped=sum(all(get[t](i) == "skip" for t in TARGETS) for i in ids))
        if got["llama-server"] is not None and got["offgrid"] is not None:
            missing = [i for i in ids if get["llama-server"](i) == "pass"
                       and get["offgrid"](i) == "fail"]
            file_gaps = []
            ran.add(file)
            for i in missing:
                listed = by_design(file, i, patterns)
                used.update(p for p, _, _ in patterns
                            if fnmatch.fnmatchcase("%s::%s" % (file, i), p))
                if listed is None:
                    file_gaps.append(i)
                    causes[(GAP, "no reason listed in deliberate.txt (gaps.md has the "
                            "failures)")].append((file, i))
                else:
                    causes[(listed[1], listed[0])].append((file, i))
            row.update(gaps=len(file_gaps), by_design=len(missing) - len(file_gaps),
                       both_fail=sum(get["llama-server"](i) == "fail"
                                     and get["offgrid"](i) == "fail" for i in ids),
                       offgrid_only=sum(get["llama-server"](i) == "fail"
                                        and get["offgrid"](i) == "pass" for i in ids))
            gaps[file] = [(i, got["offgrid"][i][1]) for i in file_gaps]
        rows.append(row)
    # entries of files that ran on both servers which explained nothing this run:
    # the test passes now (or fails on llama-server too), so the entry may go
    stale = [p for p, _, _ in patterns if p not in used and p.split("::", 1)[0] in ran]
    if stale:
        causes[(STALE, ", ".join(stale))] = []
    kinds = [kind for _, _, kind in patterns]
    order = [GAP] + [k for i, k in enumerate(kinds) if k not in kinds[:i]] + [STALE]
    by_cause = [{"kind": kind, "cause": why, "tests": ["%s::%s" % t for t in tests]}
                for (kind, why), tests in sorted(
                    causes.items(), key=lambda kv: (order.index(kv[0][0])
                                                    if kv[0][0] in order else len(order),
                                                    -len(kv[1]), kv[0][1]))]
    return rows, gaps, {f: sorted(t) for f, t in dropped.items()}, \
        {f: sorted(t) for f, t in on_purpose.items()}, by_cause


def render_causes(by_cause):
    """The by-cause table: every test that passes on llama-server and fails on offgrid,
    under its reason (deliberate.txt's, or none: a gap)."""
    lines = ["Tests that pass on llama-server and fail on offgrid, by cause "
             "(`deliberate.txt`):", "",
             "| kind | cause | tests | where |", "|---|---|---:|---|"]
    total, notes = Counter(), []
    for c in by_cause:
        if c["kind"] == STALE:
            notes = ["", "Entries that matched no such test in the files run (the test passes "
                     "on offgrid now, or fails on llama-server too): " + c["cause"]]
            continue
        files = Counter(t.split("::", 1)[0] for t in c["tests"])
        where = ", ".join("%s (%d)" % (f, n) if n > 1 else f for f, n in sorted(files.items()))
        kind = "**%s**" % c["kind"] if c["kind"] == GAP else c["kind"]
        lines.append("| %s | %s | %d | %s |" % (kind, c["cause"].replace("|", "\\|"),
                                                len(c["tests"]), where))
        total[c["kind"]] += len(c["tests"])
    lines.append("| **total** | %s | %d | |" % (
        ", ".join("%s %d" % (k, n) for k, n in total.items()) or "none",
        sum(total.values())))
    return "\n".join(lines + notes) + "\n"


def plural(n, word):
    return "%d %s%s" % (n, word, "" if n == 1 else "s")


def render(rows, gaps, dropped, on_purpose=None, by_cause=None):
    def cell(row, key):
        v = row.get(key)
        return "-" if v is None else str(v)
    keys = ("tests", "llama", "offgrid", "gaps", "by_design", "both_fail", "offgrid_only",
            "skipped")
    lines = ["| file | tests | pass llama-server | pass offgrid | gaps | listed | both fail "
             "| offgrid only | skipped |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = Counter()
    for row in rows:
        if not row["run"]:
            lines.append("| %s | not run | | | | | | | |" % row["file"])
            continue
        lines.append("| %s | %s |" % (row["file"], " | ".join(cell(row, k) for k in keys)))
        for k in keys:
            total[k] += row.get(k) or 0
    lines.append("| **total** | %s |" % " | ".join(str(total[k]) for k in keys))
    if by_cause is not None:
        lines += [""] + render_causes(by_cause).splitlines()
    lines += ["", "Flags offgrid does not take (dropped by the launcher), by the number "
              "of tests that passed them:", ""]
    for flag, tests in sorted(dropped.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append("- dropped: %s, used by %s" % (flag, plural(len(tests), "test")))
    if not dropped:
        lines.append("- none")
    lines += ["", "Flags offgrid leaves aside on purpose (docs/compatibility.md, \"Differences from "
              "llama-server\"), by the number of tests that passed them:", ""]
    for flag, tests in sorted((on_purpose or {}).items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append("- on purpose: %s, used by %s" % (flag, plural(len(tests), "test")))
    if not on_purpose:
        lines.append("- none")
    lines += ["", "Runs: seconds, load average (1 min) before and after, when, at which "
              "commit, `-k` if any:", ""]
    for row in rows:
        for target, info in sorted(row.get("runs", {}).items()):
            lines.append("- %s on %s: %s s, load %s, %s at %s%s" % (
                row["name"], target,
                int(info["seconds"]), " to ".join(str(x) for x in info.get("load", [])) or "?",
                info.get("ended", "?"), info.get("commit", "?"),
                ", -k %r" % info["k"] if info.get("k") else ""))
    table = "\n".join(lines) + "\n"
    gap_lines = ["# Gaps: pass on llama-server, fail on offgrid", ""]
    for file, items in gaps.items():
        if items:
            gap_lines.append("## " + file)
            gap_lines += ["- `%s`: %s" % (test, why) for test, why in items]
            gap_lines.append("")
    return table, "\n".join(gap_lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma list of file names (infill, completion, ...)")
    p.add_argument("--all", action="store_true",
                   help="the files of endpoints other issues add, too (OTHERS)")
    p.add_argument("--target", choices=TARGETS + ["both"], default="both")
    p.add_argument("--table", action="store_true", help="rebuild the table from results/ only")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per file and server")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("--slow", action="store_true",
                   help="run the tests marked slow too (SLOW_TESTS=1; most of test_tool_call)")
    p.add_argument("--install", action="store_true",
                   help="only install the suite's test-only packages")
    args = p.parse_args(argv)
    if args.install:
        ensure_packages(sys.executable)
        return 0
    names = args.only.split(",") if args.only else CORE + (OTHERS if args.all else [])
    listed = CORE + OTHERS + [n for n in names if n not in CORE + OTHERS]

    if not args.table:
        python = sys.executable
        ensure_packages(python)
        tests_dir = suite.prepare()
        targets = TARGETS if args.target == "both" else [args.target]
        binary = llama_server() if "llama-server" in targets else None
        began = time.monotonic()
        for name in names:
            for target in targets:
                rc, took = run_file(name, target, tests_dir, python, binary, args.timeout,
                                    args.k, args.slow)
                print("conformance:   %s, %.0f s" % ("exit %s" % rc, took), flush=True)
        print("conformance: %d file(s) on %s in %.0f s%s" % (
            len(names), " and ".join(targets), time.monotonic() - began,
            "" if args.slow else ", slow tests left out (--slow runs them)"), flush=True)

    rows, gaps, dropped, on_purpose, by_cause = summarize(listed)
    table, gap_text = render(rows, gaps, dropped, on_purpose, by_cause)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "table.md").write_text(table)
    (RESULTS / "gaps.md").write_text(gap_text)
    (RESULTS / "summary.json").write_text(json.dumps(
        {"rows": rows, "gaps": gaps, "dropped": dropped, "on_purpose": on_purpose,
         "by_cause": by_cause}, indent=1))
    print()
    print(table)
    print("gaps with their failures: %s" % (RESULTS / "gaps.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
