"""Drafts for answers that copy their prompt (engine/copydraft.py), and which
requests get them (drafter_for).  The model-driven checks, that the output
stays plain decoding's, are in test_speculation.py."""

from offgrid.engine.copydraft import SIZES, CopyDraft, carries_answer, drafter_for


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _drive(lk, truth, cap=63, step_cost=lambda n: 1.0, n_steps=10 ** 6):
    """As the session drives it: draft() before each decode, append() for each
    token the step gives (the drafted ones that match ``truth``, then one
    more).  Returns [(draft length, hits)] of the drafted steps."""
    pos, steps = len(lk.tokens), []
    for _ in range(n_steps):
        if pos >= len(truth):
            break
        d = lk.draft(cap)
        lk.clock.t += step_cost(len(d))
        hits = 0
        while hits < len(d) and pos + hits < len(truth) and truth[pos + hits] == d[hits]:
            hits += 1
        if d:
            steps.append((len(d), hits))
        for t in truth[pos:pos + hits + 1]:
            lk.append(t)
        pos += hits + 1
    return steps


def _text(n, seed=1):
    """n tokens of a 'file' that does not repeat itself: every bigram unique."""
    return [1000 + seed * 100000 + i for i in range(n)]


def test_a_copy_drafts_long_from_the_right_place():
    body = _text(300)
    prompt = [1, 2] + body + [3, 4]         # the file, then "write it again:"
    truth = prompt + body
    lk = CopyDraft(prompt, clock=_Clock())
    # the answer's first token has no match; then the copy starts
    steps = _drive(lk, truth)
    lengths = [n for n, _ in steps]
    assert all(h == n for n, h in steps[:-1]), steps    # every draft came true...
    assert max(lengths) == 63                           # ...and grew to the longest size
    assert len(steps) < 300 / 15


def test_an_edit_costs_a_short_draft_and_the_copy_resumes_after_it():
    body = _text(200)
    prompt = body + [3, 4]
    # the answer: the body with token 100 replaced by two new ones (a rename)
    answer = body[:100] + [77, 78] + body[101:]
    lk = CopyDraft(prompt + answer[:1], clock=_Clock())
    steps = _drive(lk, prompt + answer)
    failed = [(n, h) for n, h in steps if h < n]
    # the draft that ran into the edit, at most one more, and the answer's end
    assert len(failed) <= 3, steps
    # after the edit the copy picks up again, from the token after the old one
    assert lk._src is not None
    after = steps[[i for i, (n, h) in enumerate(steps) if h < n][0] + 1:]
    assert sum(h for _, h in after) >= 80, steps


def test_the_longest_match_wins_over_the_latest():
    # (5, 6) occurs twice; the end matches the first occurrence further back
    a, b = _text(20, 1), _text(20, 2)
    prompt = [9, 8, 7, 5, 6] + a + [0, 5, 6] + b + [9, 8, 7, 5, 6]
    lk = CopyDraft(prompt, clock=_Clock())
    lk.k = 15
    # a match of 5 tokens: drafts of up to 7 (a short match is less sure)
    assert lk.lookup(15) == a[:7]


def test_short_matches_draft_short_and_no_match_drafts_nothing():
    lk = CopyDraft([1, 2, 3, 50, 51, 52, 53, 54, 55, 56, 57, 9, 9, 2, 3], clock=_Clock())
    assert lk.lookup(63) == [50, 51, 52]    # a 2-token match: the shortest size
    lk = CopyDraft([1, 2, 3, 4, 5], clock=_Clock())
    assert lk.lookup(63) == []


def test_draft_sizes_adapt_up_and_fall_back():
    lk = CopyDraft(_text(10), clock=_Clock())
    lk._adapt([0] * 7, 7)
    assert lk.k == 31           # all came true: two sizes up
    lk._adapt([0] * 31, 31)
    assert lk.k == 63
    lk._adapt([0] * 63, 2)
    assert lk.k == SIZES[0]     # what came true, and one more
    lk._adapt([0] * 63, 40)
    assert lk.k == 7            # a probe after a change, however long the run before
    need = lk._need
    lk._adapt([0] * 7, 0)
    assert lk._need == 2 * need     # nothing came true: a longer match to draft again
    lk._adapt([0] * 3, 3)
    assert lk._need == need


def test_drafting_stops_for_a_request_where_it_does_not_pay():
    """Drafts that mostly fail on a machine where a verify decode is dear:
    drafted steps lose to plain ones, and the request stops drafting."""
    body = _text(100)
    # the answer keeps starting like the prompt and then going elsewhere
    truth = list(body)
    for i in range(40):
        truth += body[i * 2:i * 2 + 3] + _text(3, seed=10 + i)
    lk = CopyDraft(body, clock=_Clock())
    _drive(lk, truth, step_cost=lambda n: 1.0 + 1.0 * n)
    assert not lk.paying


def test_which_prompts_carry_their_answer():
    code = "```python\n" + "".join("line %d\n" % i for i in range(8)) + "```\n"
    assert carries_answer("Rename x to y in this:\n" + code)
    assert carries_answer("<|file_sep|>a.py\nx = 1\n<|file_sep|>updated/a.py\n")
    assert carries_answer("<|editable_region_start|>\nfoo\n<|editable_region_end|>")
    assert not carries_answer("What does `x = 1` do?\n```\nx = 1\n```\n")   # a short quote
    assert not carries_answer("Write a poem about the sea.")
    assert not carries_answer("```python\n" + "a\n" * 10)     # never closed


def test_spec_types_keep_their_meaning_and_edits_draft_under_each():
    edit = "```\n" + "x\n" * 10 + "```"
    plain = "Tell me a story."
    for spec in ("edits", "auto", "ngram-simple", "ngram-mod"):
        assert drafter_for(spec, True, False, lambda: edit) == "copy"
        assert drafter_for(spec, False, False, lambda: edit) == "copy"
    assert drafter_for("none", True, False, lambda: edit) == ""
    # the rest as before: edits none, auto completions and FIM, ngram-simple all
    assert drafter_for("edits", False, False, lambda: plain) == ""
    assert drafter_for("edits", False, True, lambda: plain) == ""
    assert drafter_for("auto", False, False, lambda: plain) == "lookup"
    assert drafter_for("auto", False, True, lambda: plain) == "lookup"
    assert drafter_for("auto", True, False, lambda: plain) == ""
    assert drafter_for("ngram-simple", True, False, lambda: plain) == "lookup"
    assert drafter_for("ngram-mod", True, False, lambda: plain) == "copy"
    # fill-in-the-middle is never a copy (its answer is what is missing)
    assert drafter_for("auto", False, True, lambda: edit) == "lookup"


def test_a_change_the_text_made_once_is_drafted_where_it_comes_again():
    """A rename: the first time the text writes the new name the draft fails
    there; once the copy resumes, the change is learned, and the next places
    the old name comes in the prompt are drafted with the new one."""
    old, new = 500, 600
    body = []
    for i in range(6):          # six lines, each with the old name in it
        body += _text(30, seed=20 + i) + [old, 7, 8]
    prompt = body + [3, 4]
    answer = [new if t == old else t for t in body]
    lk = CopyDraft(prompt + answer[:1], clock=_Clock())
    steps = _drive(lk, prompt + answer)
    assert lk._rules and lk._rules[0] == ((old,), (new,))
    failed = [(n, h) for n, h in steps if h < n]
    # the first rename costs a failed draft (and a probe); the other five none
    assert len(failed) <= 3, steps
    assert sum(h for _, h in steps) >= len(answer) - 2 * 33, steps


NL = 9          # the line break token of the tests' texts


def _lines(n, seed, length=12):
    """n lines of ``length`` tokens, each ending in NL, every bigram unique."""
    return [_text(length - 1, seed=seed * 100 + i) + [NL] for i in range(n)]


def test_lines_copied_out_of_order_are_drafted_from_their_second_token():
    """An answer that takes the prompt's lines in another order: once two of
    the latest three line ends went elsewhere than the copy's next line, each
    line is drafted to its end from where its first token matches, and no
    further; the line ends stop costing failed drafts."""
    lines = _lines(20, seed=30)
    prompt = [1, 2, NL] + [t for ln in lines for t in ln] + [3, 4, NL]
    order = [7, 2, 15, 0, 11, 4, 19, 9, 13, 1, 17, 5]
    answer = [t for i in order for t in lines[i]]
    lk = CopyDraft(prompt, clock=_Clock(), newline=lambda t: t == NL)
    steps = _drive(lk, prompt + answer)
    assert not lk.in_order()
    # after the first lines, a line: its first token, then one draft of the
    # rest of it (11 tokens, its line break included; less after a step the
    # judge keeps plain to time it), all true, never past the line's end
    late = steps[-8:]
    assert all(n == h <= 11 for n, h in late), steps
    assert [n for n, _ in late].count(11) >= 6, steps
    assert sum(h for _, h in steps) >= len(answer) - 3 * len(order) - 24, steps


def test_an_ambiguous_line_start_drafts_only_what_its_places_share():
    """Two places a line may come from, both matching its start: only the
    tokens both would draft, until a token tells them apart."""
    a = [NL, 50, 51, 52, 60, 61, 62, NL]
    b = [NL, 50, 51, 52, 70, 71, 72, NL]
    lk = CopyDraft([5, 6] + a + [7, 8] + b + [NL, 50], clock=_Clock(),
                   newline=lambda t: t == NL)
    lk._in_order = False
    assert lk.lookup(63) == [51, 52]
    lk = CopyDraft([5, 6] + a + [7, 8] + b + [NL, 50, 51, 52, 70], clock=_Clock(),
                   newline=lambda t: t == NL)
    lk._in_order = False
    assert lk.lookup(63) == [71, 72, NL]


def test_lines_in_order_keep_drafting_across_line_ends():
    lines = _lines(30, seed=40)
    prompt = [1, 2, NL] + [t for ln in lines for t in ln] + [3, 4, NL]
    answer = [t for ln in lines for t in ln]
    lk = CopyDraft(prompt + answer[:1], clock=_Clock(), newline=lambda t: t == NL)
    steps = _drive(lk, prompt + answer)
    assert lk.in_order()
    assert max(n for n, _ in steps) == 63
    assert len(steps) < len(answer) / 15, steps


def test_an_indent_the_lines_share_does_not_say_they_come_in_order():
    """Lines that all start with the same indent token, taken out of order: the
    indent after a line end matches the copy's next line whatever line comes,
    so the next line's first word tells whether the copy went on in order."""
    IND = 8
    lines = [[IND] + ln for ln in _lines(20, seed=50)]
    prompt = [1, 2, NL] + [t for ln in lines for t in ln] + [3, 4, NL]
    order = [7, 2, 15, 0, 11, 4, 19, 9, 13, 1, 17, 5]
    answer = [t for i in order for t in lines[i]]
    lk = CopyDraft(prompt, clock=_Clock(), newline=lambda t: t == NL,
                   blank=lambda t: t == IND)
    steps = _drive(lk, prompt + answer)
    assert not lk.in_order()
    late = steps[-8:]
    assert all(n == h for n, h in late), steps


def _stubs_and_docs(n=10):
    """Stubs (a "def" line, then an indented "pass" line and a blank line, each)
    and their docstrings in another block: the answer puts each docstring
    between its stub's two lines, as an apply-edit answer does."""
    DEF, IND, PASS, COLON_NL, BLANK_NL, DOC_NL, HASH = 20, 21, 22, 23, 24, 25, 26
    stubs = [[DEF] + _text(6, seed=60 + i) + [COLON_NL] for i in range(n)]
    docs = [[IND] + _text(8, seed=80 + i) + [DOC_NL] for i in range(n)]
    pas = [IND, PASS, BLANK_NL]
    prompt = [1, 2, NL] + [t for s in stubs for t in s + pas] + [3, NL]
    for i in (5, 2, 8, 0, 7, 3, 9, 6, 1, 4):
        prompt += [HASH] + _text(2, seed=60 + i) + [NL] + docs[i]
    prompt += [3, 4, NL]
    answer = [t for i in range(n) for t in stubs[i] + docs[i] + pas]
    newline = {NL, COLON_NL, BLANK_NL, DOC_NL}
    return prompt, answer, (lambda t: t in newline), (lambda t: t == IND)


def test_the_line_that_comes_next_in_the_copy_is_drafted_from_its_start():
    """After a stub's "pass" line (taken from the stubs, after a docstring from
    elsewhere), the next stub follows in the stubs' order: it is drafted from
    its first token, with the "pass" line's end, though every stub starts
    alike; a docstring's first tokens are not guessed from the stub before it
    once that went elsewhere."""
    prompt, answer, newline, blank = _stubs_and_docs()
    lk = CopyDraft(prompt, clock=_Clock(), newline=newline, blank=blank)
    steps = _drive(lk, prompt + answer)
    assert not lk.in_order()
    # after the first stub: two drafts a function, both true: the docstring
    # from its second token, then the "pass" line's rest with the next stub
    # (a stub's first token, drafted after a step of its own, would be three)
    assert all(n == h for n, h in steps[2:]), steps
    assert len(steps) <= 3 + 2 * 9, steps
