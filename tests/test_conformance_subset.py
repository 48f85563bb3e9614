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
