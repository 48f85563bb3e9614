"""Generation: a ChatSession's ``complete`` (its prompt evaluated, then tokens
sampled, drafted and checked, text released) as a part of ChatSession of
its own.

The loop is plain Python around three C calls per token (llama_decode,
llama_sampler_sample, a cached token->bytes lookup); with a grammar,
sampling takes a few more (see sampling.py).  Drafts (engine/lookup.py,
copydraft.py, draftmodel.py) are decoded with the token before them and
kept as far as the sampler agrees with them.

Everything here reads and writes the session's state (engine/session.py:
``cached``, its context and batch member), so it is a base class of
ChatSession, not a thing of its own.
"""

import time

from .. import libllama
from ..errors import DecodeError
from ..request import Completion, FinishReason, GenerationParams, RequestCancel, TokenProb, Usage
from .copydraft import CopyDraft
from .lookup import PromptLookup
from .sampling import ProbsReader, build_sampler
from .textstream import TextAssembler, TokenLedger
from .thinkbudget import ThinkBudget


class Generation:
    """ChatSession's generation (engine/session.py has the rest of it)."""

    def complete(self, tokens, params=None, on_piece=None, cancel=None, on_progress=None,
                 on_evaluated=None):
        """Evaluate the prompt ``tokens``, then generate.

        ``on_piece(text)`` is called with each piece of text that is final (no
        half characters, no part of a stop string); returning False stops
        generation as cancelled.  With ``params.with_probs`` it is called as
        ``on_piece(text, probs)``, ``probs`` the TokenProbs of the tokens whose
        text the piece completes (text may then be "" for a token of no text),
        and the Completion's ``probs`` holds them all; with
        ``params.piece_tokens`` (and no probs) the second argument is those
        tokens' ids.  ``on_progress``: see
        evaluate.  ``on_evaluated()`` is called once the whole prompt is in the
        cache, before the first token is sampled.  Returns a Completion.
        """
        params = params or GenerationParams()
        params.sampling.validate()
        cancel = cancel or RequestCancel()
        self._check_open()
        usage = self.usage = Usage(prompt_tokens=len(tokens))

        self._member.watch(cancel)
        sampler = reader = None
        n_decodes = self.n_decodes
        try:
            t0 = time.perf_counter()
            usage.cached_tokens = self._evaluate(tokens, cancel, params.cache_prompt,
                                                params.cache_reuse,
                                                need_logits=params.n_predict != 0,
                                                on_progress=on_progress)
            usage.prompt_ms = (time.perf_counter() - t0) * 1000.0
            if cancel.cancelled or len(self.cached) < len(tokens):
                # report only the prompt work done: what the cache holds now
                # less what it kept (a cancelled gap leaves holes: None)
                held = sum(1 for t in self.cached if t is not None)
                usage.evaluated = max(0, min(held - usage.cached_tokens,
                                             usage.prompt_tokens - usage.cached_tokens))
                return Completion("", [], FinishReason.CANCELLED, "none", "", usage)
            if on_evaluated is not None:
                on_evaluated()
            if params.n_predict == 0:
                # warm-up: the prompt is now cached; nothing to generate
                return Completion("", [], FinishReason.LENGTH, "limit", "", usage)

            model = self.model
            eog_ban = self._eog_tokens() if params.ignore_eos else ()
            probs = params.with_probs
            post = probs and params.post_sampling_probs and not params.sampling.greedy
            if (params.sampling.grammar is not None or probs
                    or params.sampling.rescue_grammar is not None) and self._candidates is None:
                self._candidates = libllama.Candidates(model.lib, model.n_vocab)
            sampler = build_sampler(model.lib, params.sampling, model.n_vocab, self.n_ctx, eog_ban,
                                    vocab=model.handle.vocab, candidates=self._candidates,
                                    keep_candidates=post, piece_of=model.token_bytes)
            if probs:
                reader = ProbsReader(model.lib, self._candidates, params.n_probs,
                                     params.post_sampling_probs, params.sampling.greedy)
            # Penalties count the prompt's last tokens too, as llama-server's
            # do; the grammar does not see them (it constrains only the output).
            if params.sampling.has_penalties:
                for t in tokens[-max(params.sampling.repeat_last_n, 0):] if \
                        params.sampling.repeat_last_n >= 0 else tokens:
                    sampler.accept(t, grammar=False)
            budget = ThinkBudget(params.think) if params.think else None
            if budget is None:
                return self._generate(tokens, params, sampler, on_piece, cancel, usage, reader)
            # /v1/chat/completions/control's "reasoning_end" reaches it from the
            # worker's frame reader: the budget takes it at its next step
            cancel.attach_control(budget.control)
            try:
                return self._generate(tokens, params, sampler, on_piece, cancel, usage, reader,
                                      budget)
            finally:
                cancel.detach_control(budget.control)
        finally:
            usage.n_decode = self.n_decodes - n_decodes
            self._member.unwatch()
            self._member.release()
            if sampler is not None:
                sampler.close()
            if reader is not None:
                reader.close()

    def _generate(self, prompt, params, sampler, on_piece, cancel, usage, reader=None,
                  budget=None):
        model, ctx = self.model, self._ctx
        text = TextAssembler(params.stop, params.n_indent, params.fim_suffix, params.fim_indent)
        # which tokens each piece shows: their TokenProbs (with a reader), or
        # their ids (params.piece_tokens); the plain path does no more work
        ledger = TokenLedger() if reader is not None or params.piece_tokens else None
        live = usage if params.timings_per_token else None
        out_tokens = []
        n_past = len(prompt)
        finish, stop_type, truncated = FinishReason.LENGTH, "limit", False
        t_start = time.perf_counter()
        t_max = params.t_max_predict_ms / 1000.0 if params.t_max_predict_ms > 0 else 0.0
        limit = params.n_predict if params.n_predict > 0 else None
        n_eog = 0
        # Speculation (see _speculation): ``pending`` holds the drafted tokens
        # decoded after the last kept one, not yet checked; ``idx`` is the batch
        # index of the output of the last decode the sampler reads.
        lookup = self._speculation(prompt, params, reader, cancel)
        draft_cap = self.copy_draft_max if isinstance(lookup, CopyDraft) else self.draft_max
        if self.memory.drafts is not None:
            draft_cap = min(draft_cap, self.memory.drafts)     # what can be taken back
        pending, idx = [], self._out
        drafted = accepted = steps = 0

        while True:
            if cancel.cancelled:
                finish, stop_type = FinishReason.CANCELLED, "none"
                break
            forced = budget.forced() if budget is not None else None
            if forced is not None and sampler.allows(forced):
                # the reasoning budget is spent: its end, whatever the model would pick
                token = forced
                sampler.accept(token)
                sampler.observe(token)
            else:
                if forced is not None:
                    budget.give_up()
                token = sampler.sample(ctx, idx)
            if budget is not None and token is not None:
                budget.accept(token, model.token_bytes(token))
            in_cache = False
            if pending:
                if token == pending[0]:
                    # the draft was right: its keys and values are in place
                    pending.pop(0)
                    accepted += 1
                    idx += 1
                    in_cache = True
                else:
                    # wrong from here on: drop the rest of the draft's cells
                    self._drop_after(n_past)
                    pending = []
            if token is None:
                # the grammar allows nothing the samplers would pick: the
                # end of what can be generated (libllama would have aborted)
                finish, stop_type = FinishReason.STOP, "eos"
                break
            if model.is_eog(token) and not params.ignore_eos:
                # counted as generated (llama-server's tokens_predicted and
                # OpenAI's completion_tokens include it) but never shown
                n_eog = 1
                finish, stop_type = FinishReason.STOP, "eos"
                break
            out_tokens.append(token)
            if lookup is not None:
                lookup.append(token)
            piece = (model.token_text(token)
                     if params.special or token in params.preserved_tokens
                     else model.token_bytes(token))
            released, stopped = text.add(piece)
            if live is not None:
                live.completion_tokens = len(out_tokens)
                live.generation_ms = (time.perf_counter() - t_start) * 1000.0
            if ledger is None:
                if released and on_piece is not None and on_piece(released) is False:
                    finish, stop_type = FinishReason.CANCELLED, "none"
                    cancel.cancel("client")
                    break
            else:
                ledger.add(piece, token if reader is None
                           else self._token_prob(reader, token, piece, idx, params.special))
                got = ledger.release(text.sent, len(text.text) if stopped else None)
                if (released or got) and on_piece is not None \
                        and on_piece(released, got) is False:
                    finish, stop_type = FinishReason.CANCELLED, "none"
                    cancel.cancel("client")
                    break
            if stopped:
                if text.stop_word is not None:
                    finish, stop_type = FinishReason.STOP, "word"
                else:
                    finish, stop_type = FinishReason.LENGTH, "limit"
                break
            if limit is not None and len(out_tokens) >= limit:
                break
            if t_max and b"\n" in piece and time.perf_counter() - t_start > t_max:
                break
            if n_past + 1 >= self.n_ctx:
                truncated = True
                if pending or in_cache:
                    # a shift keeps only cells it moves: this token (and any
                    # draft after it) is decoded again after the shift
                    self._drop_after(n_past)
                    pending, in_cache = [], False
                if not self._shift_context(params, len(prompt)):
                    break
                n_past = len(self.cached)
            if in_cache:
                n_past += 1     # decoded with the draft already
                continue
            draft = []
            if lookup is not None:
                room = min(self.n_ctx - n_past - 2, self.n_batch - 1,
                           limit - len(out_tokens) - 1 if limit is not None else self.n_batch)
                # the logits are read: the others' steps need not wait for
                # this draft (a draft model's decodes take a while)
                self._member.release()
                draft = lookup.draft(min(draft_cap, room))
                if draft and min(draft) < 0:
                    # an image's media id (engine/media.py) is no token to decode
                    draft = draft[:[t < 0 for t in draft].index(True)]
            status = self._decode_one(token, n_past, draft)
            if status == 2:
                finish, stop_type = FinishReason.CANCELLED, "none"
                pending = []        # nothing of this decode is in the cache
                break
            if status != 0:
                self._fail(status)
            n_past += 1
            self.cached.append(token)
            idx = self._out     # the sampler reads this decode's outputs now
            if draft:
                self.cached += draft
                pending = list(draft)
                drafted += len(draft)
                steps += 1
                if not getattr(lookup, "judges_itself", False) \
                        and drafted >= self.draft_probation \
                        and accepted < self.draft_keep * drafted:
                    lookup = None   # too few drafts come true here to pay for checking them

        if (pending or len(self.cached) > n_past) and self.cached:
            self._drop_after(n_past)    # a stop came before the draft's end
        tail = text.finish()
        if ledger is None:
            if tail and on_piece is not None and finish is not FinishReason.CANCELLED:
                on_piece(tail)
        else:
            # FIM: the text may end before a repeat of the suffix, at len(text.text)
            got = (ledger.finish(len(text.text)) if text.stop_word is None
                   and not text.indent_stop else [])
            if (tail or got) and on_piece is not None and finish is not FinishReason.CANCELLED:
                on_piece(tail, got)
        usage.completion_tokens = len(out_tokens) + n_eog
        usage.generation_ms = (time.perf_counter() - t_start) * 1000.0
        usage.draft_tokens, usage.draft_accepted, usage.draft_steps = drafted, accepted, steps
        c = Completion(text.text, out_tokens, finish, stop_type, text.stop_word or "",
                       usage, truncated)
        if reader is not None:
            c.probs = ledger.released
        return c

    # Speculation: drafts of up to draft_max tokens (engine/lookup.py); a
    # request whose first draft_probation drafted tokens came true less than
    # draft_keep of the time stops drafting (a verify decode of 1 + k tokens
    # costs more than one token's, and a wrong draft buys nothing).
    draft_probation = 32
    draft_keep = 0.3

    def _speculation(self, prompt, params, reader, cancel=None):
        """A PromptLookup (or the draft model's drafter) for this request, or
        None where it cannot draft.

        Not with token probabilities (the reader reads one output), nor with a
        grammar or the tool-call rescue's (a draft the grammar forbids is only
        wasted work, and the grammar path is the hostile-input path: kept
        plain), nor where the
        cache cannot take a wrong draft back (a recurrent state without
        snapshots: engine/memory.py).
        """
        if self.draft_max <= 0 or not params.speculate or reader is not None \
                or params.sampling.grammar is not None or self.memory.drafts == 0 \
                or params.sampling.rescue_grammar is not None \
                or params.n_predict == 1 or not params.drafter:
            return None
        if params.drafter == "copy":
            token_bytes = self.model.token_bytes
            return CopyDraft(prompt, k_max=self.copy_draft_max,
                             newline=lambda t: b"\n" in token_bytes(t),
                             blank=lambda t: not token_bytes(t).strip())
        if self.draft_model is not None:
            return self.draft_model.drafter(self._member.index, prompt, cancel)
        return PromptLookup(prompt)

    def _drop_after(self, n):
        """Forget the cache past its first n positions (a draft's wrong tokens),
        and read the cut back: a recurrent state cut further than its
        snapshots go would otherwise stay as it was."""
        back = len(self.cached) - n
        if self.memory.has_state and back > self._rollback_ok:
            self._replay_to(n)
            return
        ok = self.memory.cuts_anywhere or back <= self._rollback_ok
        self._rollback_ok = 0
        at = self.positions.at
        if not (ok and self._mem.rm(at(n), -1)
                and self._mem.seq_pos_max(self._seq) == self.positions.last(n)):
            self.reset()        # cannot happen where _speculation allows drafts
            raise DecodeError("libllama could not drop a draft's cells", -1)
        del self.cached[n:]

    def _token_prob(self, reader, token, piece, idx, special=False):
        """The TokenProb of ``token``, just sampled from output ``idx`` (before the
        next decode); ``special``: the candidates' control tokens shown as text (-sp)."""
        p, top = reader.read(self._ctx, token, idx)
        text = self.model.token_text if special else self.model.token_bytes
        return TokenProb(token, piece, p, [TokenProb(t, text(t), q) for t, q in top])

    def _eog_tokens(self):
        # all of them, as llama-server bans for ignore_eos: an EOG token left
        # open would end a grammar's text, or be "generated" as nothing
        return self.model.eog_tokens()
