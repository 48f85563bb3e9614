"""What pyproject.toml declares is what the checkout uses.

The Makefile installs the test-only packages into .venv (scripts/venv.sh), and
tests/conformance/run.py the conformance suite's; pyproject.toml's extras
(``pip install offgrid[test]``, ``[conformance]``) must name the same, or a
tester who installs from pyproject gets a suite that cannot run.  Its
``packages`` must list every package of offgrid/, or a pip install leaves
one out.
"""

import ast
import re

try:
    from .serverproc import ROOT
except ImportError:
    from serverproc import ROOT


def pyproject_list(section, key):
    """A list of strings in pyproject.toml: ``key = [...]`` under ``[section]``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    body = text.split("[%s]" % section, 1)[1].split("\n[", 1)[0]
    m = re.search(r"^%s\s*=\s*(\[.*?\])" % re.escape(key), body, re.M | re.S)
    assert m, "pyproject.toml has no %s in [%s]" % (key, section)
    return ast.literal_eval(m.group(1))       # TOML's list of strings is Python's too


def makefile_installs():
    """The requirements the Makefile's venv recipe hands pip."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    recipe = text.split("$(VENV)/.ready:", 1)[1].split("\n\n", 1)[0]
    (line,) = [ln for ln in recipe.splitlines() if "bash scripts/venv.sh" in ln]
    return re.findall(r'"([^"]+)"', line)


def conformance_packages():
    """tests/conformance/run.py's PACKAGES, the names pip installs."""
    text = (ROOT / "tests" / "conformance" / "run.py").read_text(encoding="utf-8")
    m = re.search(r"^PACKAGES = (\{.*?\})", text, re.M | re.S)
    return list(ast.literal_eval(m.group(1)).values())


def test_test_extras_are_what_the_makefile_installs():
    makefile = makefile_installs()
    assert "pytest>=7" in makefile      # the parse found the recipe
    assert sorted(pyproject_list("project.optional-dependencies", "test")) == sorted(makefile)


def test_conformance_extras_are_what_its_runner_installs():
    wanted = pyproject_list("project.optional-dependencies", "conformance")
    assert sorted(wanted) == sorted(conformance_packages())


def test_every_package_of_offgrid_is_packaged():
    found = sorted(".".join(p.parent.relative_to(ROOT).parts)
                   for p in (ROOT / "offgrid").rglob("__init__.py"))
    assert sorted(pyproject_list("tool.setuptools", "packages")) == found
