"""plan(): which cached runs a new prompt can reuse, and what is left to evaluate."""

from offgrid.engine.cachereuse import plan


def seq(start, n):
    return list(range(start, start + n))


def test_without_min_run_only_the_common_prefix_is_kept():
    cached = seq(0, 100)
    p = plan(cached, seq(0, 50) + [999] + seq(50, 50), min_run=0)
    assert p.keep == 50 and p.runs == [] and p.gaps(101) == [(50, 101)]


def test_a_whole_cached_prompt_still_evaluates_its_last_token():
    p = plan(seq(0, 10), seq(0, 10), min_run=4)
    assert p.keep == 9 and p.gaps(10) == [(9, 10)]


def test_removed_piece_shifts_the_rest_left():
    cached = seq(0, 40) + seq(1000, 30) + seq(40, 100) + [7]
    prompt = seq(0, 40) + seq(40, 100) + [8]
    p = plan(cached, prompt, min_run=16)
    assert p.keep == 40
    assert p.runs == [(40, 70, 100)]
    assert p.gaps(len(prompt)) == [(140, 141)]
    assert p.reused == 140


def test_inserted_text_before_the_suffix_is_a_gap_and_the_suffix_is_reused():
    prefix, line, suffix = seq(0, 200), [5000, 5001], seq(300, 120)
    cached = prefix + line + suffix + [9]
    prompt = prefix + line + [5002] + suffix + [9]       # one more token typed
    p = plan(cached, prompt, min_run=32)
    assert p.keep == 202
    assert p.runs == [(203, 202, 120)]
    assert p.gaps(len(prompt)) == [(202, 203), (323, 324)]


def test_short_runs_are_not_worth_moving():
    cached = seq(0, 20) + seq(500, 10) + seq(20, 10)
    prompt = seq(0, 20) + seq(20, 10) + [1]
    assert plan(cached, prompt, min_run=16).runs == []


def test_runs_come_in_cache_order():
    a, b = seq(100, 40), seq(200, 40)
    cached = [1, 2] + b + a + [3]
    prompt = [1, 2] + a + b + [3]
    p = plan(cached, prompt, min_run=16)
    # a is found after b in the cache; b, earlier in the cache, cannot follow it
    assert p.runs == [(2, 42, 40)]


def test_a_run_is_found_after_many_earlier_copies_of_its_start():
    # code repeats itself: the suffix's first tokens occur many times earlier
    common = [1, 2, 3, 4, 5, 6, 7, 8]
    noise = []
    for i in range(40):
        noise += common + [100 + i]
    suffix = common + seq(500, 80)
    cached = [0] + noise + [42] + suffix + [9]
    prompt = [0] + noise + [43] + suffix + [9]
    p = plan(cached, prompt, min_run=32)
    assert p.runs and p.runs[-1][2] >= len(suffix)
