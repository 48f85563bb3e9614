"""The llama-server conformance tests that offgrid passes today, kept passing.

``make conformance`` runs llama.cpp's own server tests against llama-server
and offgrid (tests/conformance/run.py).  The tests listed in
``tests/conformance/passing.txt`` pass on offgrid; this runs them, against
offgrid only, in the suite's own pytest (a subprocess, with the suite's
conftest and its ServerProcess), and fails naming the ones that no longer pass.
`make test` installs the suite's test-only packages first (requests, wget, ...).
"""

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "conformance"))
import run as conformance   # noqa: E402
import suite                # noqa: E402

PASSING = ROOT / "tests" / "conformance" / "passing.txt"


def passing_tests():
    lines = (line.split("#", 1)[0].strip() for line in PASSING.read_text().splitlines())
    return [line for line in lines if line]


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
