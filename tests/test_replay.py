"""The front answers every recorded request as it did when it was recorded.

tests/replay.py holds the cases (a few hundred requests over every route and
dialect, streamed and not, errors included, on the three test models) and
the normaliser; tests/golden/replay/*.json hold the responses recorded from
the code before the front's reorganisation (issue 35).  This test starts the
same servers (its own: it needs no other test's traffic), sends every case
in its order, and compares each normalised response with its recording:
status, the headers clients read, the body, each stream event in order.
A failure names the case and the path of each differing field.

To re-record (only for a deliberate change of behaviour, then read the diff
of tests/golden/replay/):

    python3 tests/replay.py --record      # twice from fresh servers; must agree
    python3 tests/replay.py --check       # the diffs, without pytest

A whole replay takes about a minute and a half on 2 busy cores.
"""

import pytest

try:
    from . import replay
except ImportError:
    import replay


@pytest.fixture(scope="module")
def replayed():
    """Every group's cases, run in order on fresh servers: {case id: normalised response}."""
    return replay.run_groups()


@pytest.fixture(scope="module")
def recorded():
    return {name: {c["name"]: c for c in replay.load_golden(name)["cases"]}
            for name in replay.GROUPS}


def test_every_recorded_case_is_still_asked(recorded):
    for name, group in replay.GROUPS.items():
        asked = [c.name for c in group.cases]
        assert asked == list(recorded[name]), (
            "group %s: the cases are not the recorded ones (added, removed or reordered); "
            "re-record with `python3 tests/replay.py --record`" % name)


@pytest.mark.parametrize("case", replay.CASES, ids=lambda c: c.id)
def test_response_is_the_recorded_one(replayed, recorded, case):
    problems = replay.compare_case(case, recorded[case.group].get(case.name),
                                   replayed[case.id])
    assert not problems, "%s %s %s differs from its recording:\n  %s" % (
        case.id, case.method, case.path, "\n  ".join(problems))
