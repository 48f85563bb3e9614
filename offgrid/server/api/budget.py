"""What one response may make the front hold: token probabilities.

Token probabilities are the one part of a response that grows much faster
than its text: with ``n_probs`` N each generated token carries N + 1 entries,
and the front held, per entry, about 1.2 KB at its peak (measured: SmolLM2,
four prompts of 300 tokens with n_probs 20, 28-33 MB more front RSS for a
2.2 MB response; with n_probs 1024 that was issue 37's +1.08 MB per token).
So the fields are capped (``fields.MAX_N_PROBS``: 20 alternatives, OpenAI's
own bound on ``top_logprobs``), and a response that is not streamed, which
holds every entry until it is written, must fit its worst case (jobs x
tokens x (alternatives + 1)) in MAX_PROB_ENTRIES, 131072 entries, about 150
MB at the peak, else a 400 that says how to fit (fewer tokens, alternatives,
prompts or choices, or stream it).  A streamed one holds none once written
(what waits for a slow client is bounded in ``models/worker_client.py``), and
the front as a whole has its ceiling (``httpd/frontmem.py``).
"""

from ..httpd.httperrors import BadRequest

MAX_PROB_ENTRIES = 1 << 17

def check_probs(gen, n_jobs, n_ctx, stream):
    """Refuse (400) a response that would hold more than MAX_PROB_ENTRIES token
    probabilities: ``n_jobs`` generations of ``gen`` (n_predict, or a whole
    context of ``n_ctx`` when unset), not streamed."""
    if not gen.with_probs or stream:
        return
    tokens = gen.n_predict if gen.n_predict > 0 else n_ctx
    per_token = gen.n_probs + 1
    need = n_jobs * tokens * per_token
    if need > MAX_PROB_ENTRIES:
        raise BadRequest(
            "this response would hold up to %d token probabilities (%d generation%s x %d "
            "tokens x %d each), past the %d a response that is not streamed may hold; ask "
            "for fewer tokens (n_predict, max_tokens), fewer alternatives (n_probs, "
            "top_logprobs, logprobs), fewer prompts or choices, or stream it"
            % (need, n_jobs, "" if n_jobs == 1 else "s", tokens, per_token, MAX_PROB_ENTRIES))
