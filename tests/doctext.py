"""Reading the docs as tests/test_docs.py runs them: code blocks, commands, marks, links.

A page is README.md or docs/*.md.  Its fenced blocks each name a language;
``sh`` blocks hold commands, one a line, a line ending in a backslash or
inside an open quote going on to the next (the JSON bodies span lines inside
single quotes); comment lines between commands are dropped.  An HTML comment
on the line before a fence marks the block for the test, invisibly on the
rendered page:

    <!-- docs-test: not run -->                 the test does not run it
    <!-- docs-test: not run: make test -->      nor, of this block, the commands
                                                that begin so (several: "; " between)
    <!-- docs-test: run by tests/test_x.py -->  another test runs it

Nothing here runs anything.
"""

import re
import shlex
from collections import namedtuple
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the languages a fence may name: an unnamed fence could hide a command
LANGUAGES = {"sh", "ini", "json", "text"}
MARK = re.compile(r"^<!-- docs-test: (.*?) -->$")

Block = namedtuple("Block", "page line lang text mark")
Command = namedtuple("Command", "page line text mark")


def pages():
    """README.md and every docs/*.md, as paths relative to the checkout."""
    return [Path("README.md")] + sorted(p.relative_to(ROOT) for p in (ROOT / "docs").glob("*.md"))


def blocks(page):
    """The fenced blocks of a page, each with the mark on the line before it (or None)."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, "%s:%d: a code block that never closes" % (page, i + 1)
        mark = MARK.match(lines[i - 1]) if i else None
        out.append(Block(page, i + 1, fence.group(1).strip(), "\n".join(lines[i + 1:end]) + "\n",
                         mark.group(1) if mark else None))
        i = end + 1
    return out


def commands(block):
    """The commands of an sh block, continuation lines joined."""
    found, pending, first = [], "", 0
    for n, line in enumerate(block.text.splitlines()):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = n
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(pending)
        except ValueError:          # an open quote: the command goes on
            continue
        found.append(Command(block.page, block.line + 1 + first, pending.strip(),
                             mark_of(pending, block.mark)))
        pending = ""
    assert not pending, "%s:%d: an unterminated command:\n%s" % (block.page, block.line, pending)
    return found


def mark_of(command, mark):
    """A command's own mark: its block's, or for "not run: A; B", "not run" where the
    command begins with A or B and none elsewhere."""
    if mark is None or not mark.startswith("not run: "):
        return mark
    prefixes = mark[len("not run: "):].split("; ")
    return "not run" if any(bare(command).startswith(p) for p in prefixes) else None


def all_commands():
    return [c for page in pages() for b in blocks(page) if b.lang == "sh" for c in commands(b)]


def uncommented(command):
    """A command without its trailing ``# ...`` comments, quoting and all else kept."""
    out, quote, prev = [], None, " "
    for ch in command:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            out.append("\0")       # to the end of the line
        if out and out[-1] == "\0" and ch != "\n":
            prev = ch
            continue
        if out and out[-1] == "\0":
            out.pop()
        out.append(ch)
        prev = ch
    if out and out[-1] == "\0":
        out.pop()
    return "".join(out).rstrip()


def bare(command):
    """A command as its words, comments dropped: what the test's patterns match."""
    return " ".join(shlex.split(command, comments=True))


# -- links -------------------------------------------------------------------------------

def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page):
    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}


def links(page):
    """(target, anchor) of every relative Markdown link of a page, outside code."""
    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out
