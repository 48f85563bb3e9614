"""The llama-server conformance tests that offgrid passes today, kept passing.

``make conformance`` runs llama.cpp's own server tests against llama-server
and offgrid (tests/conformance/run.py).  The tests listed in
``tests/conformance/passing.txt`` pass on offgrid; this runs them, against
offgrid only, in the suite's own pytest (a subprocess, with the suite's
conftest and its ServerProcess), and fails naming the ones that no longer pass.
`make test` installs the suite's test-only packages first (requests, wget, ...).
Also: the runner leaves the suite's slow tests out unless asked, as tests.sh.
"""

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
import run as conformance   # noqa: E402
import suite                # noqa: E402

PASSING = ROOT / "tests" / "conformance" / "passing.txt"


def passing_tests():
    lines = (line.split("#", 1)[0].strip() for line in PASSING.read_text().splitlines())
    return [line for line in lines if line]


@pytest.mark.slow
def test_the_conformance_tests_offgrid_passed_still_pass():
    tests = passing_tests()
    assert tests, "%s lists no test" % PASSING
    tests_dir = suite.prepare()
    with tempfile.TemporaryDirectory() as tmp:
        xml, log = Path(tmp) / "out.xml", Path(tmp) / "launches.jsonl"
        env = conformance.suite_env("offgrid", log)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "--junitxml", str(xml), "-o", "junit_family=xunit1"] + tests,
                              cwd=str(tests_dir), env=env, capture_output=True, text=True,
                              timeout=300)
        assert xml.is_file(), "the suite did not run:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
        failed = []
        ran = 0
        for case in ET.parse(xml).iter("testcase"):
            ran += 1
            if any(child.tag in ("failure", "error", "skipped") for child in case):
                failed.append(case.get("name"))
    assert not failed, "no longer pass on offgrid: %s\n%s" % (failed, proc.stdout[-4000:])
    assert ran == len(tests), "ran %d of %d listed tests:\n%s" % (ran, len(tests),
                                                                  proc.stdout[-3000:])


def test_the_runner_leaves_slow_tests_out_unless_asked(tmp_path, monkeypatch):
    # a suite of three tests: one marked slow, one that skips itself unless
    # SLOW_TESTS=1 (as the suite's is_slow_test_allowed()); run as the real one is
    unit = tmp_path / "suite" / "unit"
    unit.mkdir(parents=True)
    (unit.parent / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    (unit / "test_demo.py").write_text(
        "import os, pytest\n"
        "def test_quick():\n    pass\n"
        "@pytest.mark.skipif(os.environ.get('SLOW_TESTS') != '1', reason='slow')\n"
        "def test_gated():\n    pass\n"
        "@pytest.mark.slow\n"
        "def test_slow():\n    pass\n")
    monkeypatch.setattr(conformance, "RESULTS", tmp_path / "results")
    monkeypatch.setenv("SLOW_TESTS", "1")      # the caller's setting does not leak in
    quick = {"test_quick": "pass", "test_gated": "skip"}
    every = {"test_quick": "pass", "test_gated": "pass", "test_slow": "pass"}
    for slow, expected in ((False, quick), (True, every)):
        rc, _ = conformance.run_file("demo", "offgrid", unit.parent, sys.executable, None,
                                     60, slow=slow)
        assert rc == 0
        got = conformance.outcomes("offgrid", "demo")
        assert {test: outcome for test, (outcome, _why) in got.items()} == expected
        info = conformance.run_info("offgrid", "demo")
        assert info["slow"] is slow and info["deselected"] == (0 if slow else 1)
    rows = conformance.summarize(["demo"])[0]
    assert rows[0]["file"] == "test_demo.py (slow tests run)"


def _junit(path, outcomes):
    """A JUnit XML file of {test: "pass" | "fail" | "skip"}, as pytest writes it."""
    cases = []
    for test, outcome in outcomes.items():
        inner = {"pass": "", "fail": '<failure message="assert 1 == 2"/>',
                 "skip": '<skipped message="no"/>'}[outcome]
        cases.append('<testcase classname="unit.test_demo" name="%s">%s</testcase>'
                     % (test, inner))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('<testsuites><testsuite name="pytest">%s</testsuite></testsuites>'
                    % "".join(cases))


def test_the_table_gives_the_gaps_by_cause_with_deliberate_txts_kinds(tmp_path, monkeypatch):
    # five tests llama-server passes: two offgrid passes too, one is listed on
    # purpose, one as not built yet, one has no reason (a gap)
    monkeypatch.setattr(conformance, "RESULTS", tmp_path / "results")
    listed = tmp_path / "deliberate.txt"
    listed.write_text("# a comment\n"
                      "test_demo.py::test_cors[[]*   # CORS off by default\n"
                      "[not built yet]\n"
                      "test_demo.py::test_draft   # draft models: no registry pair\n"
                      "test_demo.py::test_ok   # passes now: explains nothing\n")
    monkeypatch.setattr(conformance, "DELIBERATE", listed)
    tests = ["test_ok", "test_ok2", "test_cors[a]", "test_draft", "test_new"]
    _junit(tmp_path / "results" / "llama-server" / "test_demo.xml", {t: "pass" for t in tests})
    _junit(tmp_path / "results" / "offgrid" / "test_demo.xml",
           {"test_ok": "pass", "test_ok2": "pass", "test_cors[a]": "fail", "test_draft": "fail",
            "test_new": "fail"})
    assert conformance.deliberate()[:2] == [
        ("test_demo.py::test_cors[[]*", "CORS off by default", "on purpose"),
        ("test_demo.py::test_draft", "draft models: no registry pair", "not built yet")]
    rows, gaps, _, _, by_cause = conformance.summarize(["demo"])
    assert rows[0]["gaps"] == 1 and rows[0]["by_design"] == 2
    assert gaps == {"test_demo.py": [("test_new", "assert 1 == 2")]}
    assert [(c["kind"], c["tests"]) for c in by_cause] == [
        ("gap", ["test_demo.py::test_new"]),
        ("on purpose", ["test_demo.py::test_cors[a]"]),
        ("not built yet", ["test_demo.py::test_draft"]),
        ("unused", [])]
    table, _ = conformance.render(rows, gaps, {}, {}, by_cause)
    assert "matched no such test in the files run" in table and "::test_ok" in table
    assert "| not built yet | draft models: no registry pair | 1 | test_demo.py |" in table
    assert "| **total** | gap 1, on purpose 1, not built yet 1 | 3 | |" in table
