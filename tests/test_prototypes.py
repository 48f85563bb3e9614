"""Every C function offgrid binds has, in ctypes, the argument and return types of the pinned llama.h.

ctypes trusts the prototype it is given: an int32 passed where C takes an
int64, a missing argument, a bool read as an int, all "work" and pass
garbage in the high bits of a register.  So each prototype of
``libllama._PROTOTYPES`` (and the ggml ones) is turned back into C, from the
ctypes types themselves, and compiled against the headers:

    static int32_t (*const check_llama_decode)(struct llama_context *, struct llama_batch) = llama_decode;

gcc refuses (with -Werror=incompatible-pointer-types) unless the function
pointer type we derive is exactly the declared one: every argument, its
count, the return type, the const on each pointee.  ctypes' own types carry
no struct names or const; libllama.py spells those with ``_spelled`` types,
which pass as c_void_p and friends but say which C type they stand for.
Integers are spelled as the C type their ctypes class is on this platform
(c_int32 is ``int``, c_uint64 ``unsigned long``), which is what must agree.
"""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from offgrid import libllama

try:
    from . import tinymodels
except ImportError:  # tests/ is on sys.path rather than a package
    import tinymodels

# ctypes' classes and the C types they are.  ctypes aliases classes of the
# same size (c_int32 is c_int; on LP64 c_longlong is c_long), so later
# entries win: "long" over "long long", as glibc's int64_t and size_t are.
_SCALARS = dict([
    (ctypes.c_longlong, "long long"), (ctypes.c_ulonglong, "unsigned long long"),
    (ctypes.c_bool, "_Bool"), (ctypes.c_byte, "signed char"), (ctypes.c_ubyte, "unsigned char"),
    (ctypes.c_short, "short"), (ctypes.c_ushort, "unsigned short"), (ctypes.c_int, "int"),
    (ctypes.c_uint, "unsigned int"), (ctypes.c_long, "long"), (ctypes.c_ulong, "unsigned long"),
    (ctypes.c_float, "float"), (ctypes.c_double, "double"),
    (ctypes.c_void_p, "void *"), (ctypes.c_char_p, "const char *"),
])


def c_type(ctype):
    """The C spelling of a ctypes type as offgrid uses it."""
    if ctype is None:
        return "void"
    spelled = vars(ctype).get("_c_")
    if spelled:
        return spelled
    if ctype in _SCALARS:
        return _SCALARS[ctype]
    if issubclass(ctype, ctypes.Structure):
        return "struct " + ctype.__name__
    if issubclass(ctype, ctypes._Pointer):
        return c_type(ctype._type_) + " *"
    raise TypeError("no C spelling for %r" % ctype)


def function_type(restype, argtypes, name=""):
    """``RET (*name)(ARGS)`` for a prototype."""
    args = ", ".join(c_type(t) for t in argtypes) or "void"
    return "%s (*%s)(%s)" % (c_type(restype), name, args)


def c_program(tables, callbacks):
    """C source with one function-pointer initialisation per bound function."""
    lines = ['#include "llama.h"', '#include "ggml-backend.h"', '#include "ggml-cpu.h"',
             '#include "ggml-rpc.h"', ""]
    for table in tables:
        for name, (restype, argtypes) in sorted(table.items()):
            lines.append("static %s = %s;" % (function_type(restype, argtypes,
                                                            "const check_" + name), name))
    for cb in callbacks:
        restype, argtypes = cb._c_signature_
        lines.append("static %s const check_cb_%s = (%s) 0;"
                     % (cb._c_, cb._c_, function_type(restype, argtypes)))
    return "\n".join(lines) + "\n"


PATCHES = Path(__file__).resolve().parent.parent / "scripts" / "patches"


def patched_include(src, tmp_path):
    """A copy of the pinned include/ with what scripts/patches change in it (0005
    declares llama_init_from_model_streams): the headers lib/ is built from."""
    out = tmp_path / "patched"
    shutil.copytree(src / "include", out / "include")
    for patch in sorted(PATCHES.glob("*.patch")):
        # the patch's sections for include/ files only
        parts = re.split(r"(?m)^(?=--- a/)", patch.read_text("utf-8"))[1:]
        mine = "".join(p for p in parts if p.startswith("--- a/include/"))
        if mine:
            done = subprocess.run(["patch", "--quiet", "--forward", "-p1", "-d", str(out)],
                                  input=mine, capture_output=True, text=True)
            assert done.returncode == 0, (patch.name, done.stdout + done.stderr)
    return out / "include"


def compile_errors(source, tmp_path):
    """gcc's complaints about ``source`` against the pinned headers as patched ('' if none)."""
    src = tinymodels.llama_cpp_source()
    header = src / "include" / "llama.h"
    assert header.is_file(), "llama.h not found at %s (run `make lib`)" % header
    path = tmp_path / "prototypes.c"
    path.write_text(source)
    cmd = ["gcc", "-std=gnu11", "-fsyntax-only", "-Werror=incompatible-pointer-types",
           "-Werror=int-conversion", "-I", str(patched_include(src, tmp_path)),
           "-I", str(src / "ggml" / "include"), str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stderr


TABLES = (libllama._PROTOTYPES, libllama._GGML_PROTOTYPES, libllama._PROC_PROTOTYPES)
CALLBACKS = (libllama.ggml_log_callback, libllama.llama_progress_callback,
             libllama.ggml_abort_callback_t)


def test_every_bound_function_has_llama_h_types(tmp_path):
    errors = compile_errors(c_program(TABLES, CALLBACKS), tmp_path)
    assert not errors, "ctypes prototypes differ from the pinned headers:\n" + errors


# The checker itself: each kind of drift must fail to compile, naming the function.

_P = libllama._PROTOTYPES
_DRIFTS = {
    # llama_pos is int32_t: an int64 argument would pass garbage high bits
    "widened argument": ("llama_memory_seq_rm", (ctypes.c_bool, [
        libllama.llama_memory_t, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32])),
    "missing argument": ("llama_memory_seq_rm", (ctypes.c_bool, _P["llama_memory_seq_rm"][1][:-1])),
    "wrong return type": ("llama_memory_seq_rm", (ctypes.c_int32, _P["llama_memory_seq_rm"][1])),
    "float as double": ("llama_sampler_init_top_p", (libllama.llama_sampler_p,
                                                     [ctypes.c_double, ctypes.c_size_t])),
    "another struct pointer": ("llama_sampler_free", (None, [libllama.llama_context_p])),
    "const dropped": ("llama_model_n_swa", (ctypes.c_int32, [libllama.llama_model_p])),
    "struct by value": ("llama_decode", (ctypes.c_int32, [libllama.llama_context_p,
                                                          ctypes.POINTER(libllama.llama_batch)])),
}


@pytest.mark.parametrize("drift", sorted(_DRIFTS))
def test_the_check_catches_a_wrong_prototype(drift, tmp_path):
    name, prototype = _DRIFTS[drift]
    assert prototype != _P[name]
    errors = compile_errors(c_program([{name: prototype}], ()), tmp_path)
    assert errors and "check_" + name in errors


def test_the_check_catches_a_wrong_callback_signature(tmp_path):
    wrong = libllama._callback("ggml_log_callback", None,
                               [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p])
    # enum ggml_log_level has no negative values: gcc makes it unsigned int
    errors = compile_errors(c_program([], [wrong]), tmp_path)
    assert errors and "check_cb_ggml_log_callback" in errors
