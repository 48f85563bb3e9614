"""The ctypes structs in offgrid.libllama match the pinned llama.h, field by field.

A struct passed by value with the wrong layout does not fail loudly: libllama
reads a neighbour's bytes as a flag or a pointer and the process corrupts
itself later.  So every class in ``libllama.STRUCTS`` is checked two ways:

- its field names, in order, equal the C field names read from the header's
  text (llama.h, and ggml.h for the one ggml struct offgrid fills).
  This catches a field added, removed, renamed or moved, even one that
  padding would hide from sizeof (a bool added after the last bool);
- a small C program compiled with gcc against the header prints sizeof and
  alignof of each struct, and offsetof, sizeof and the kind (pointer, float,
  signed or unsigned integer, bool) of every field the ctypes class
  names.  Those must equal what ctypes computes.

The C program is generated from the ctypes classes, so a field that exists in
Python but not in C fails to compile, and the test says which.
"""

import ctypes
import platform
import re
import subprocess

import pytest

from offgrid import libllama

try:
    from . import tinymodels
except ImportError:  # tests/ is on sys.path rather than a package
    import tinymodels


def _header_dirs():
    src = tinymodels.llama_cpp_source()
    return src / "include" / "llama.h", [src / "include", src / "ggml" / "include"]


def _headers():
    """llama.h and the ggml.h it includes: where the structs offgrid passes are declared."""
    llama_h, include_dirs = _header_dirs()
    return [llama_h, include_dirs[1] / "ggml.h"]


# --------------------------------------------------------------------------
# Reading llama.h
# --------------------------------------------------------------------------

def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def header_fields(header_text, struct_name):
    """(name, declaration) of each field of ``struct struct_name { ... }``, in order."""
    text = _strip_comments(header_text)
    m = re.search(r"\bstruct\s+%s\s*\{((?:[^{}]|\{[^{}]*\})*)\}" % re.escape(struct_name),
                  text)
    if m is None:
        raise LookupError("struct %s has no body in llama.h" % struct_name)
    # an anonymous union's members are the struct's own fields (at one offset)
    body = re.sub(r"\bunion\s*\{([^{}]*)\}\s*;", r"\1", m.group(1))
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        fn_ptr = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)     # bool (*cb)(void *)
        if fn_ptr:
            fields.append((fn_ptr.group(1), decl))
            continue
        for declarator in decl.split(","):                  # float a, b
            name = re.search(r"(\w+)\s*(\[[^\]]*\]\s*)*$", declarator).group(1)
            fields.append((name, decl))
    return fields


# --------------------------------------------------------------------------
# The compiled side
# --------------------------------------------------------------------------

# _Generic tells bool and floats apart; gcc's __builtin_classify_type tells
# pointers (5) from integers (1).  An enum reads as a signed or unsigned int,
# whichever its values need, so enums are recognised from llama.h's text.
_C_PRELUDE = r"""
#include <stdio.h>
#include <stddef.h>
#include "llama.h"

#define KIND(x) _Generic((x), _Bool: "bool", float: "float", double: "float", \
    default: __builtin_classify_type(x) == 5 ? "pointer" : \
             __builtin_classify_type(x) == 1 ? (((__typeof__(x)) -1 < 0) ? "int" : "uint") : \
             "other")
#define FIELD(S, f) printf("F %s %s %zu %zu %s\n", #S, #f, offsetof(struct S, f), \
                           sizeof(((struct S *) 0)->f), KIND(((struct S *) 0)->f))
/* an array field: the kind of its elements (the array itself decays to a pointer) */
#define ARRAY(S, f) printf("F %s %s %zu %zu %s\n", #S, #f, offsetof(struct S, f), \
                           sizeof(((struct S *) 0)->f), KIND(((struct S *) 0)->f[0]))

int main(void) {
"""


def flat_fields(cls):
    """cls._fields_ with an anonymous union (``_anonymous_``) given as its members, which
    C names as the struct's own."""
    out = []
    for field, ctype in cls._fields_:
        if field in getattr(cls, "_anonymous_", ()):
            out += flat_fields(ctype)
        else:
            out.append((field, ctype))
    return out


def c_program(structs):
    """C source printing the layout of every struct and every field ctypes names."""
    lines = [_C_PRELUDE]
    for cls in structs:
        name = cls.__name__
        lines.append('    printf("S %s %%zu %%zu\\n", sizeof(struct %s), _Alignof(struct %s));'
                     % (name, name, name))
        for field, ctype in flat_fields(cls):
            macro = "ARRAY" if issubclass(ctype, ctypes.Array) else "FIELD"
            lines.append("    %s(%s, %s);" % (macro, name, field))
    lines.append("    return 0;\n}\n")
    return "\n".join(lines)


def ctypes_kind(ctype):
    """The C kind of a ctypes field type, in the words KIND() prints."""
    if issubclass(ctype, ctypes.Array):
        return ctypes_kind(ctype._type_)
    if ctype in (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p) or \
            issubclass(ctype, (ctypes._Pointer, ctypes._CFuncPtr)):
        return "pointer"
    code = getattr(ctype, "_type_", None)
    if code in ("f", "d", "g"):
        return "float"
    if code == "?":
        return "bool"
    if code == "c":         # C's plain char: signed on x86, unsigned on ARM
        return "uint" if platform.machine().lower().startswith(("arm", "aarch64")) else "int"
    if isinstance(code, str) and code in "bBhHiIlLqQ":
        return "int" if code.islower() else "uint"
    return "other"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    """{struct: (sizeof, alignof, {field: (offset, size, kind)})} as gcc lays them out."""
    header, include_dirs = _header_dirs()
    assert header.is_file(), "llama.h not found at %s (run `make lib`)" % header
    work = tmp_path_factory.mktemp("layout")
    (work / "layout.c").write_text(c_program(libllama.STRUCTS))
    cmd = ["gcc", "-std=gnu11", "-o", str(work / "layout"), str(work / "layout.c")]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, "the layout program does not compile against llama.h " \
        "(a ctypes field that C lacks?):\n" + built.stderr
    out = subprocess.run([str(work / "layout")], capture_output=True, text=True, check=True).stdout

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
    for header in _headers():
        assert header.is_file(), "%s not found (run `make lib`)" % header
    return "\n".join(h.read_text() for h in _headers())


# --------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------

def mismatches(cls, c_layout, declared):
    """Every way ``cls`` differs from the C struct of the same name, as text."""
    name = cls.__name__
    problems = []
    names = [f for f, _ in flat_fields(cls)]
    header_names = [f for f, _ in declared]
    enums = {f for f, decl in declared if decl.startswith("enum ")}
    if names != header_names:
        problems.append("fields differ from llama.h:\n  C:      %s\n  ctypes: %s"
                        % (header_names, names))
    c_size, c_align, c_fields = c_layout[name]
    if (ctypes.sizeof(cls), ctypes.alignment(cls)) != (c_size, c_align):
        problems.append("sizeof/alignof: C %d/%d, ctypes %d/%d"
                        % (c_size, c_align, ctypes.sizeof(cls), ctypes.alignment(cls)))
    for field, ctype in flat_fields(cls):
        if field not in c_fields:
            problems.append("%s: not in the C struct" % field)
            continue
        offset, size, kind = c_fields[field]
        if field in enums:
            kind = "int"        # ctypes spells a C enum as c_int
        py = (getattr(cls, field).offset, ctypes.sizeof(ctype), ctypes_kind(ctype))
        if py != (offset, size, kind):
            problems.append("%s: C offset %d size %d %s, ctypes offset %d size %d %s"
                            % ((field, offset, size, kind) + py))
    return problems


@pytest.mark.parametrize("cls", libllama.STRUCTS, ids=lambda c: c.__name__)
def test_struct_matches_llama_h(cls, c_layout, header_text):
    problems = mismatches(cls, c_layout, header_fields(header_text, cls.__name__))
    assert not problems, "%s:\n%s" % (cls.__name__, "\n".join(problems))


def test_every_struct_class_in_the_bindings_is_checked():
    defined = {obj for obj in vars(libllama).values()
               if isinstance(obj, type) and issubclass(obj, ctypes.Structure)
               and obj.__module__ == libllama.__name__}
    assert defined == set(libllama.STRUCTS)


# The checker itself: each kind of drift a repin could bring must be caught.

def _variant(base, fields):
    return type(base.__name__, (ctypes.Structure,), {"_fields_": fields})


_ARRAY = libllama.llama_token_data_array
_DRIFTS = {
    "reordered": _variant(_ARRAY, [_ARRAY._fields_[1], _ARRAY._fields_[0]] + _ARRAY._fields_[2:]),
    "removed": _variant(_ARRAY, _ARRAY._fields_[:-1]),
    # a trailing bool fits in the padding: sizeof and every offset still agree
    "added_in_padding": _variant(_ARRAY, _ARRAY._fields_ + [("extra", ctypes.c_bool)]),
    "retyped": _variant(_ARRAY, _ARRAY._fields_[:2] + [("selected", ctypes.c_double)]
                        + _ARRAY._fields_[3:]),
}


@pytest.mark.parametrize("drift", sorted(_DRIFTS))
def test_the_check_catches_drift(drift, c_layout, header_text):
    cls = _DRIFTS[drift]
    assert mismatches(cls, c_layout, header_fields(header_text, cls.__name__))


def test_the_check_catches_a_field_llama_h_adds_in_padding(c_layout, header_text):
    # what a repin could do without moving any offset or changing sizeof
    grown = header_text.replace("bool sorted;", "bool sorted; bool extra;", 1)
    assert grown != header_text
    assert mismatches(_ARRAY, c_layout, header_fields(grown, _ARRAY.__name__))
