"""offgrid/libmtmd.py's prototypes and structs are the pinned mtmd.h and mtmd-helper.h's.

The same two checks as libllama's (tests/test_prototypes.py, tests/test_layout.py),
pointed at libmtmd's headers: every bound function, turned back into a C
function-pointer type from its ctypes types, must initialise from the declared
function without a warning gcc is told to make an error; every struct offgrid
passes (two by value: mtmd_context_params, mtmd_helper_init_opt; one returned
by value: mtmd_helper_bitmap_wrapper) must have the header's fields, in order,
at the offsets and sizes gcc lays them out.
"""

import subprocess

import pytest

from offgrid import libmtmd

try:
    from . import test_layout, test_prototypes, tinymodels
except ImportError:  # tests/ is on sys.path rather than a package
    import test_layout
    import test_prototypes
    import tinymodels


def _include_dirs(tmp_path):
    src = tinymodels.llama_cpp_source()
    mtmd = src / "tools" / "mtmd"
    assert (mtmd / "mtmd.h").is_file(), "mtmd.h not found under %s (run `make lib`)" % src
    return [test_prototypes.patched_include(src, tmp_path), src / "ggml" / "include", mtmd]


def _gcc(source, tmp_path, out=None):
    path = tmp_path / "mtmd_check.c"
    path.write_text(source)
    cmd = ["gcc", "-std=gnu11", "-Werror=incompatible-pointer-types", "-Werror=int-conversion"]
    cmd += ["-o", str(out)] if out else ["-fsyntax-only"]
    for d in _include_dirs(tmp_path):
        cmd += ["-I", str(d)]
    return subprocess.run(cmd + [str(path)], capture_output=True, text=True)


def _prototypes_program(table):
    lines = ['#include "mtmd.h"', '#include "mtmd-helper.h"', ""]
    for name, (restype, argtypes) in sorted(table.items()):
        lines.append("static %s = %s;" % (test_prototypes.function_type(
            restype, argtypes, "const check_" + name), name))
    return "\n".join(lines) + "\n"


def test_every_bound_mtmd_function_has_the_headers_types(tmp_path):
    done = _gcc(_prototypes_program(libmtmd._PROTOTYPES), tmp_path)
    assert done.returncode == 0, "ctypes prototypes differ from mtmd.h:\n" + done.stderr


def test_the_check_catches_a_struct_passed_by_pointer_instead_of_by_value(tmp_path):
    import ctypes
    restype, argtypes = libmtmd._PROTOTYPES["mtmd_init_from_file"]
    wrong = {"mtmd_init_from_file": (restype, argtypes[:2] + [
        ctypes.POINTER(libmtmd.mtmd_context_params)])}
    done = _gcc(_prototypes_program(wrong), tmp_path)
    assert done.returncode != 0 and "check_mtmd_init_from_file" in done.stderr


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    work = tmp_path_factory.mktemp("mtmd_layout")
    program = test_layout.c_program(libmtmd.STRUCTS).replace(
        '#include "llama.h"', '#include "mtmd.h"\n#include "mtmd-helper.h"')
    # a struct inside a struct has no scalar kind: "other", as ctypes_kind says of it
    program = program.replace(
        "FIELD(mtmd_helper_init_opt, video_params);",
        'printf("F mtmd_helper_init_opt video_params %zu %zu other\\n", '
        "offsetof(struct mtmd_helper_init_opt, video_params), "
        "sizeof(((struct mtmd_helper_init_opt *) 0)->video_params));")
    built = _gcc(program, work, out=work / "layout")
    assert built.returncode == 0, "the layout program does not compile against mtmd.h:\n" \
        + built.stderr
    out = subprocess.run([str(work / "layout")], capture_output=True, text=True,
                         check=True).stdout
    layout = {}
    for line in out.splitlines():
        parts = line.split()
        if parts[0] == "S":
            layout[parts[1]] = (int(parts[2]), int(parts[3]), {})
        else:
            _, struct, field, offset, size, kind = parts
            layout[struct][2][field] = (int(offset), int(size), kind)
    return layout


@pytest.fixture(scope="module")
def header_text():
    mtmd = tinymodels.llama_cpp_source() / "tools" / "mtmd"
    return (mtmd / "mtmd.h").read_text() + "\n" + (mtmd / "mtmd-helper.h").read_text()


@pytest.mark.parametrize("cls", libmtmd.STRUCTS, ids=lambda c: c.__name__)
def test_struct_matches_mtmd_h(cls, c_layout, header_text):
    problems = test_layout.mismatches(cls, c_layout,
                                      test_layout.header_fields(header_text, cls.__name__))
    assert not problems, "%s:\n%s" % (cls.__name__, "\n".join(problems))
