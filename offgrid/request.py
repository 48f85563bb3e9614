"""The typed request and result of one generation, shared by the front and the worker.

JSON becomes these once, at the edge (``server/params.py``); they cross to a
model's worker process as plain dicts (``protocol.py``) and the engine works
on them there.  Pure Python: importing this never loads libllama, so the
front may use it.

    SamplingParams      how to pick each next token (llama-server's names and defaults)
    GenerationParams    limits, stops and sampling of one request
    InfillRequest       the text parts of a fill-in-the-middle request
    Message, Tool, ToolCall   a chat request's messages and tools
    RequestCancel       a cancel switch, flipped from any thread
    Usage, Completion   token counts and times; the result
    TokenProb           one generated token's probability and its top alternatives
    FinishReason        why generation ended, in OpenAI's words
"""

import enum
import json
import math
import threading
import dataclasses
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional, Tuple

from .errors import InvalidRequest

# The choices of the settings the front parses and the worker obeys, written once.
REASONING_MODES = ("on", "off", "auto")                 # --reasoning
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")    # --reasoning-format
POOLINGS = ("none", "mean", "cls", "last", "rank")      # --pooling (engine/embed.POOLING)
SPEC_TYPES = ("none", "edits", "auto", "ngram-simple", "ngram-mod", "draft-simple")  # --spec-type
# -ctk / -ctv: the KV cache's types, llama-server's (common/arg.cpp kv_cache_types)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")   # -lm (libllama.LOAD_MODES)
LAZY_MODES = ("off", "auto", "on")      # -lzm (libllama.LAZY_MODES)

# llama-server's default sampler order (common_params_sampling::samplers);
# a request may reorder or drop them with "samplers".
DEFAULT_SAMPLERS = ("penalties", "top_k", "typ_p", "top_p", "min_p", "temperature")

# Names a request may use for each sampler: llama-server accepts these
# aliases in "samplers" (e.g. llama.vscode sends ["top_k", "top_p", "infill"]).
SAMPLER_ALIASES = {
    "penalties": "penalties", "top_k": "top_k", "typ_p": "typ_p", "typical_p": "typ_p",
    "typ": "typ_p", "typical": "typ_p", "top_p": "top_p", "nucleus": "top_p",
    "min_p": "min_p", "temperature": "temperature", "temp": "temperature",
    "top_n_sigma": "top_n_sigma", "xtc": "xtc",
    # DRY, which offgrid does not run: it does nothing at its default setting
    # (dry_multiplier 0), so the name is accepted and skipped; a request that sets
    # it to act is refused (server/api/fields.py), and so is a name llama-server
    # does not know
    "dry": None,
    # FIM: merges candidates that share a prefix, prefers ending when likely
    "infill": "infill",
}

# llama-server's one-letter names (its "samplers" as a string, --sampling-seq)
SAMPLER_LETTERS = {"e": "penalties", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
                   "t": "temperature", "d": "dry", "x": "xtc", "s": "top_n_sigma"}

# llama-server's default chain (common.h), where DEFAULT_SAMPLERS leaves out the
# samplers that do nothing at their defaults: a request that turns top-n-sigma or
# XTC on and names no chain gets them at these places
LLAMA_DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                          "min_p", "xtc", "temperature")

# Samplers offgrid does not run, by the field that makes each act and the value at
# which it does nothing (llama-server's defaults): a request or a flag that asks one
# to act is refused rather than silently sampled without it.
SAMPLERS_NOT_RUN = (("dry_multiplier", 0.0, "DRY"),)


def sampler_acts(name, value):
    """Whether ``value`` of SAMPLERS_NOT_RUN's field ``name`` would make its sampler act."""
    idle = next(i for n, i, _ in SAMPLERS_NOT_RUN if n == name)
    return value != idle


def sampler_chain(names):
    """The samplers that run, in order, from llama-server's names (a list) or
    letters (a string, "kfypmt"); raises ValueError naming the first it does not know."""
    if isinstance(names, str):
        names = [SAMPLER_LETTERS.get(c, c) for c in names]
    unknown = [n for n in names if n not in SAMPLER_ALIASES]
    if unknown:
        raise ValueError("unknown sampler %s; offgrid runs %s (and accepts dry at its "
                         "default, inactive setting)"
                         % (json.dumps(unknown[0][:64]),
                            ", ".join(n for n in LLAMA_DEFAULT_SAMPLERS if n != "dry")))
    return tuple(SAMPLER_ALIASES[n] for n in names if SAMPLER_ALIASES[n] is not None)


@dataclass
class SamplingParams:
    """How to pick each next token (llama-server's names and defaults)."""
    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    # the fewest candidates top_p, min_p and typical_p leave (0: llama-server's
    # default, which libllama treats as 1: the most likely token always stays)
    min_keep: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None          # None or -1: a random seed each request
    # XTC: with this probability, every candidate above the threshold but the least
    # likely of them is dropped (0: off; a threshold over 0.5: off)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0           # keep logits within n sigma of the top (<= 0: off)
    # mirostat 1 or 2 replaces the chain (but the logit bias) with temperature and
    # the mirostat pick at target surprise tau, learning rate eta (0: off)
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    samplers: Tuple[str, ...] = DEFAULT_SAMPLERS
    logit_bias: List[Tuple[int, float]] = field(default_factory=list)
    grammar: Optional[str] = None       # GBNF (rule "root"): only text it matches is sampled
    # regexes that make the grammar lazy: free text until the output matches one
    # (offgrid's own fixed patterns only: libllama cannot report a bad one)
    grammar_triggers: Tuple[str, ...] = ()
    # the tool-call rescue (chat/rescue.py): a grammar the reply is held to once
    # its start matches ``rescue_opener`` (Python's re; group 1 one of
    # ``rescue_names``) within ``rescue_watch_chars`` characters
    rescue_grammar: Optional[str] = None
    rescue_opener: str = ""
    rescue_names: Tuple[str, ...] = ()
    rescue_watch_chars: int = 0

    @property
    def greedy(self):
        """Whether the pick is the most likely token: temperature 0, and no XTC (which
        may drop the top candidates first) and no mirostat before it."""
        return self.temperature <= 0 and not self.xtc_acts and not self.mirostat

    @property
    def xtc_acts(self):
        return self.xtc_probability > 0 and self.xtc_threshold <= 0.5

    @property
    def has_penalties(self):
        return (self.repeat_last_n != 0 and
                (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                 or self.frequency_penalty != 0.0))

    @property
    def effective_samplers(self):
        """The samplers that run, in order: ``samplers`` without ``infill`` when a
        grammar is set (infill picks EOT when nothing passes its threshold, and
        accepting EOT in an unfinished grammar aborts libllama)."""
        samplers = self.samplers
        if samplers == DEFAULT_SAMPLERS and (self.xtc_acts or self.top_n_sigma > 0):
            samplers = tuple(s for s in LLAMA_DEFAULT_SAMPLERS if s != "dry")
        if self.grammar is None and self.rescue_grammar is None:
            return tuple(samplers)
        return tuple(s for s in samplers if s != "infill")

    def validate(self):
        """Raise InvalidRequest for values libllama must never see.

        From llama.h's llama_sampler_init_* (and what their code does): every
        float becomes a C float, so it must be finite there (a larger number
        turns into inf); penalty_repeat "must be > 0.0" (it divides logits);
        penalty_freq and penalty_present "must be finite"; k and
        penalty_last_n are int32_t; a logit bias of +inf or NaN poisons the
        softmax (-inf bans a token and is allowed).  top_k <= 0, top_p >= 1,
        min_p <= 0 and typical_p >= 1 turn a sampler off, as documented.
        """
        for name in ("temperature", "dynatemp_range", "dynatemp_exponent", "top_p", "min_p",
                     "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                     "xtc_probability", "xtc_threshold", "top_n_sigma", "mirostat_tau",
                     "mirostat_eta"):
            v = getattr(self, name)
            if not (math.isfinite(v) and abs(v) <= _FLT_MAX):
                raise InvalidRequest("%s must be a finite number" % name)
        if self.repeat_penalty <= 0:
            raise InvalidRequest("repeat_penalty must be greater than 0 (1.0 disables it)")
        if self.mirostat not in (0, 1, 2):
            # llama.cpp's common_sampler_init asserts on any other version
            raise InvalidRequest("mirostat must be 0 (off), 1 or 2")
        for name in ("top_k", "repeat_last_n"):
            if not _INT32_MIN <= getattr(self, name) <= _INT32_MAX:
                raise InvalidRequest("%s is out of range" % name)
        if self.repeat_last_n < -1:
            raise InvalidRequest("repeat_last_n must be -1 (the whole context) or more")
        for token, bias in self.logit_bias:
            if not _INT32_MIN <= token <= _INT32_MAX:
                raise InvalidRequest("logit_bias token %r is out of range" % (token,))
            if not (math.isfinite(bias) and abs(bias) <= _FLT_MAX) and bias != -math.inf:
                raise InvalidRequest("logit_bias values must be numbers or -inf")


# The ranges of C's float and int32_t, which sampling values are passed as.
_FLT_MAX = 3.4028234663852886e38
_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1


class FinishReason(str, enum.Enum):
    """Why generation ended, in OpenAI's words."""
    STOP = "stop"               # end-of-generation token or a stop string
    LENGTH = "length"           # n_predict, the context, or a time/indent limit
    CANCELLED = "cancelled"     # superseded, client gone, or server shutting down
    TOOL_CALLS = "tool_calls"   # set by the chat layer when the text is a tool call


class RequestCancel:
    """A cancel switch for one request, safe to flip from any thread.

    The session attaches a hook while it runs (it sets libllama's abort flag,
    so a long prompt evaluation stops within one graph node); cancel() calls
    the hooks under a lock, so a hook is never called after detach() returns.

    It carries a running request's controls the same way (llama-server's
    /v1/chat/completions/control: "reasoning_end"): control() calls the
    control hooks, each ``hook(action)`` (the front's sends the action on to
    the worker; the worker's ends the generation's thinking).
    """

    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._hooks = []
        self._controls = []
        self.reason = None

    def control(self, action):
        """Hand ``action`` to the control hooks attached now; how many there were."""
        with self._lock:
            for hook in self._controls:
                hook(action)
            return len(self._controls)

    def attach_control(self, hook):
        with self._lock:
            self._controls.append(hook)

    def detach_control(self, hook):
        with self._lock:
            if hook in self._controls:
                self._controls.remove(hook)

    def cancel(self, reason="cancelled"):
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            for hook in self._hooks:
                hook()

    @property
    def cancelled(self):
        return self._event.is_set()

    def wait(self, timeout=None):
        return self._event.wait(timeout)

    def attach(self, hook):
        with self._lock:
            self._hooks.append(hook)
            if self._event.is_set():
                hook()

    def detach(self, hook):
        with self._lock:
            if hook in self._hooks:
                self._hooks.remove(hook)


@dataclass
class Usage:
    """Token counts and times of one request (milliseconds)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose KV came from the cache
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    generation_ms: float = 0.0
    # prompt tokens decoded when a cancel stopped the prompt part way (None:
    # the whole prompt past the cached part was)
    evaluated: Optional[int] = None
    # speculation: tokens drafted from the request's own text, and how many
    # of them came true (llama-server's draft_n and draft_n_accepted)
    draft_tokens: int = 0
    draft_accepted: int = 0
    draft_steps: int = 0                # decodes that verified a draft
    # FIM under t_max_prompt_ms: what was left out of the prompt to fit the
    # budget (engine/promptfit.py), None when nothing was
    dropped: Optional[dict] = None
    n_decode: int = 0               # llama_decode calls for this request (prompt and tokens)

    @property
    def evaluated_tokens(self):
        """Prompt tokens actually decoded this request."""
        if self.evaluated is not None:
            return self.evaluated
        return self.prompt_tokens - self.cached_tokens


@dataclass
class GenerationParams:
    """What to generate: limits, stops and sampling for one request."""
    n_predict: int = -1                 # -1: until end-of-generation or a full context
    stop: List[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    cache_prompt: bool = True
    t_max_predict_ms: int = 0           # FIM: stop at a newline once this much time passed
    t_max_prompt_ms: int = 0            # FIM: fit the prompt's evaluation into this (promptfit.py)
    prompt_dropped: Optional[dict] = None   # ... and what was dropped for it (Usage.dropped)
    # control tokens whose text is kept in the output (a template's tool-call
    # markers such as <|python_tag|>, which otherwise render as nothing)
    preserved_tokens: FrozenSet[int] = frozenset()
    special: bool = False               # every control token's text kept (-sp, --special)
    cache_reuse: int = 0                # reuse cached runs of at least this many tokens
                                        # after the common prefix (0: prefix only)
    n_indent: int = 0                   # FIM: stop at a line indented less than this
    # FIM: the text after the cursor (None: not FIM) and the indentation of the
    # cursor's line; generation stops where it meets the suffix
    # (engine/textstream.SuffixStop); set by server/prompts.py
    fim_suffix: Optional[str] = None
    fim_indent: int = 0
    # context shift (a server started with --context-shift): tokens kept at the
    # start (-1: the whole prompt), and dropped after them (0: half the rest)
    n_keep: int = 0
    n_discard: int = 0
    # token probabilities (llama-server's n_probs): with_probs reports each
    # generated token's probability and its n_probs most likely alternatives
    # (OpenAI's logprobs with top_logprobs 0 wants the first without the second);
    # post_sampling_probs: after the sampler chain, else softmax of the raw logits
    with_probs: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    # draft tokens from the request's own text and verify them in one decode
    # (engine/lookup.py); the output is that of plain decoding either way
    speculate: bool = True
    # which drafter, where the server drafts at all (set by the worker from
    # --spec-type and the prompt): "lookup" (engine/lookup.py), "copy" (an
    # answer that copies its prompt: engine/copydraft.py) or "" (none)
    drafter: str = "lookup"
    # streamed requests: report the prompt's evaluation as it goes, a
    # PromptProgress before the first batch and after each (return_progress)
    return_progress: bool = False
    # streamed requests: each piece says which generated tokens it shows
    # (llama-server's "tokens" of a /completion chunk), and with
    # timings_per_token the counts and times so far (its "timings")
    piece_tokens: bool = False
    timings_per_token: bool = False
    # LoRA adapters: the request's own [id, scale] pairs (llama-server's "lora";
    # None: the server's global scales, which the front puts here before it
    # sends the request on: server/api/lora.py, engine/adapters.py)
    lora: Optional[list] = None
    # the choices of one prompt of one request (n > 1) name it alike: the first
    # to start in the worker evaluates the prompt and keeps its state, the
    # others wait for it and restore that state (engine/worker.py)
    prompt_group: Optional[str] = None
    # chat: tokens of thinking before its end is forced (llama-server's
    # reasoning_budget_tokens; -1: no bound; None: the server's --reasoning-budget),
    # and the words forced before that end (None: --reasoning-budget-message)
    reasoning_budget: Optional[int] = None
    reasoning_budget_message: Optional[str] = None
    # chat: its thinking may be ended while it runs (llama-server's reasoning_control:
    # POST /v1/chat/completions/control with action "reasoning_end")
    reasoning_control: bool = False
    # ... as the worker makes them ready for engine/thinkbudget.py (worker.think_spec)
    think: Optional[dict] = None

    def copy(self):
        """A copy whose fields, and whose sampling's, can be set apart from this one's.

        Lists inside (stop strings, logit_bias) are shared: nothing changes
        them in place once a request is parsed.  (copy.deepcopy of these
        cost a request 0.2 ms of the front's time.)
        """
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling))


@dataclass
class PromptProgress:
    """How far a request's prompt evaluation has come (llama-server's prompt_progress).

    ``cache`` tokens came from the KV cache, ``processed`` are in it now
    (cached and decoded), of ``total``; ``time_ms`` since evaluation began.
    """
    total: int
    cache: int
    processed: int
    time_ms: float = 0.0


@dataclass
class Completion:
    """The result of ChatSession.complete()."""
    text: str
    tokens: List[int]
    finish_reason: FinishReason
    stop_type: str                      # llama-server's: "eos", "word", "limit" or "none"
    stopping_word: str
    usage: Usage
    truncated: bool = False
    # tokens in the session's cache after the request (prompt and generated):
    # llama-server's tokens_cached; set by the front from the worker's answer
    n_cached: int = 0
    # chat: the parsed reply ({"content", "reasoning_content", "tool_calls"}),
    # set where the worker's chat layer read the text
    reply: Optional[dict] = None
    # with GenerationParams.with_probs: a TokenProb per generated token whose
    # text is in ``text`` (tokens wholly inside a stop string are left out)
    probs: Optional[List["TokenProb"]] = None


@dataclass
class TokenProb:
    """A generated token: its id, its bytes, its probability, and (``top``) the
    most likely tokens at that step, most likely first, each a TokenProb
    without ``top``.  ``prob`` is a probability (0..1), as libllama computes
    it in float32; the dialects show its log (llama-server's logarithm())."""
    id: int
    bytes: bytes
    prob: float
    top: List["TokenProb"] = field(default_factory=list)


@dataclass
class InfillRequest:
    """The text parts of a fill-in-the-middle request."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: List[Tuple[str, str]] = field(default_factory=list)   # (filename, text)
    prompt: str = ""            # text appended after the prefix (tokenized with specials)
    spm_infill: bool = False


# -- chat ---------------------------------------------------------------------------

@dataclass
class ToolCall:
    """One call the assistant made: a function name and its arguments as JSON text."""
    name: str
    arguments: str = "{}"
    id: str = ""


# Images and audio clips a request may hold, and the bytes of each file
# (server/api/media.py checks them at the edge; engine/media.py again)
MAX_MEDIA = 16
MAX_MEDIA_BYTES = 20 * 1024 * 1024


@dataclass
class Message:
    """One chat message.  ``parts`` holds text parts when content came as an array."""
    role: str
    content: str = ""
    parts: Optional[List[str]] = None
    reasoning_content: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""
    # images and audio clips (base64 of their files), one per media marker in
    # parts, in order (server/api/media.py; engine/media.py)
    media: List[str] = field(default_factory=list)

    def text(self):
        return self.content if self.parts is None else "\n".join(self.parts)


@dataclass
class Tool:
    """A function the model may call; ``parameters`` is a JSON schema (a dict)."""
    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)
