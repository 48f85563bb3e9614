"""llama-server's environment variables (``LLAMA_ARG_CTX_SIZE=8192``, ``LLAMA_API_KEY``,
...), read as its common/arg.cpp reads them, for the flags offgrid takes: a container
or a service file written for llama-server configures offgrid the same way.

As llama-server: a variable stands for its flag where the command line does not give
that flag (the command line wins); a switch's variable is on for 1, true, on or
enabled, and one with a negative form (``--no-context-shift``) is off for 0, false,
off or disabled, or where ``LLAMA_ARG_NO_<NAME>`` is set at all; a switch without a
negative form ignores any other value.  ``env_argv`` turns them into the flags they
stand for, put before the command line's, so every flag's own checks read them.
"""

TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")

# (variable, the flag it sets[, its negative form]), as common/arg.cpp's set_env gives
# them for the flags offgrid takes (tests/test_flag_env.py holds this to the pinned source)
ENV = (
    ('LLAMA_ARG_THREADS', '--threads'),
    ('LLAMA_ARG_NUMA', '--numa'),
    ('LLAMA_ARG_CTX_SIZE', '--ctx-size'),
    ('LLAMA_ARG_N_PREDICT', '--n-predict'),
    ('LLAMA_ARG_BATCH', '--batch-size'),
    ('LLAMA_ARG_UBATCH', '--ubatch-size'),
    ('LLAMA_ARG_SWA_FULL', '--swa-full'),
    ('LLAMA_ARG_CTX_CHECKPOINTS', '--ctx-checkpoints'),
    ('LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT', '--checkpoint-min-step'),
    ('LLAMA_ARG_CACHE_RAM', '--cache-ram'),
    ('LLAMA_ARG_KV_UNIFIED', '--kv-unified', '--no-kv-unified'),
    ('LLAMA_ARG_CONTEXT_SHIFT', '--context-shift', '--no-context-shift'),
    ('LLAMA_ARG_FLASH_ATTN', '--flash-attn'),
    ('LLAMA_ARG_TEMPERATURE', '--temp'),
    ('LLAMA_ARG_TOP_K', '--top-k'),
    ('LLAMA_ARG_TOP_P', '--top-p'),
    ('LLAMA_ARG_MIN_P', '--min-p'),
    ('LLAMA_ARG_REPEAT_PENALTY', '--repeat-penalty'),
    ('LLAMA_ARG_PRESENCE_PENALTY', '--presence-penalty'),
    ('LLAMA_ARG_FREQUENCY_PENALTY', '--frequency-penalty'),
    ('LLAMA_ARG_POOLING', '--pooling'),
    ('LLAMA_ARG_KV_OFFLOAD', '--kv-offload', '--no-kv-offload'),
    ('LLAMA_ARG_REPACK', '--repack', '--no-repack'),
    ('LLAMA_ARG_CACHE_TYPE_K', '--cache-type-k'),
    ('LLAMA_ARG_CACHE_TYPE_V', '--cache-type-v'),
    ('LLAMA_ARG_N_PARALLEL', '--parallel'),
    ('LLAMA_ARG_CONT_BATCHING', '--cont-batching', '--no-cont-batching'),
    ('LLAMA_ARG_MMPROJ', '--mmproj'),
    ('LLAMA_ARG_MMPROJ_OFFLOAD', '--mmproj-offload', '--no-mmproj-offload'),
    ('LLAMA_ARG_IMAGE_MIN_TOKENS', '--image-min-tokens'),
    ('LLAMA_ARG_IMAGE_MAX_TOKENS', '--image-max-tokens'),
    ('LLAMA_ARG_RPC', '--rpc'),
    ('LLAMA_ARG_LOAD_MODE', '--load-mode'),
    ('LLAMA_ARG_LAZY_MODE', '--lazy-mode'),
    ('LLAMA_ARG_DEVICE', '--device'),
    ('LLAMA_ARG_OVERRIDE_TENSOR', '--override-tensor'),
    ('LLAMA_ARG_CPU_MOE', '--cpu-moe'),
    ('LLAMA_ARG_N_CPU_MOE', '--n-cpu-moe'),
    ('LLAMA_ARG_N_GPU_LAYERS', '--gpu-layers'),
    ('LLAMA_ARG_SPLIT_MODE', '--split-mode'),
    ('LLAMA_ARG_TENSOR_SPLIT', '--tensor-split'),
    ('LLAMA_ARG_MAIN_GPU', '--main-gpu'),
    ('LLAMA_ARG_ALIAS', '--alias'),
    ('LLAMA_ARG_TAGS', '--tags'),
    ('LLAMA_ARG_MODEL', '--model'),
    ('LLAMA_ARG_HOST', '--host'),
    ('LLAMA_ARG_PORT', '--port'),
    ('LLAMA_ARG_CORS_ORIGINS', '--cors-origins'),
    ('LLAMA_ARG_API_PREFIX', '--api-prefix'),
    ('LLAMA_ARG_UI', '--ui', '--no-ui'),
    ('LLAMA_ARG_EMBEDDINGS', '--embedding'),
    ('LLAMA_ARG_RERANKING', '--rerank'),
    ('LLAMA_API_KEY', '--api-key'),
    ('LLAMA_ARG_API_KEY_FILE', '--api-key-file'),
    ('LLAMA_ARG_SSL_KEY_FILE', '--ssl-key-file'),
    ('LLAMA_ARG_SSL_CERT_FILE', '--ssl-cert-file'),
    ('LLAMA_ARG_CHAT_TEMPLATE_KWARGS', '--chat-template-kwargs'),
    ('LLAMA_ARG_TIMEOUT', '--timeout'),
    ('LLAMA_ARG_ROPE_SCALING_TYPE', '--rope-scaling'),
    ('LLAMA_ARG_ROPE_SCALE', '--rope-scale'),
    ('LLAMA_ARG_ROPE_FREQ_BASE', '--rope-freq-base'),
    ('LLAMA_ARG_ROPE_FREQ_SCALE', '--rope-freq-scale'),
    ('LLAMA_ARG_YARN_ORIG_CTX', '--yarn-orig-ctx'),
    ('LLAMA_ARG_YARN_EXT_FACTOR', '--yarn-ext-factor'),
    ('LLAMA_ARG_YARN_ATTN_FACTOR', '--yarn-attn-factor'),
    ('LLAMA_ARG_YARN_BETA_SLOW', '--yarn-beta-slow'),
    ('LLAMA_ARG_YARN_BETA_FAST', '--yarn-beta-fast'),
    ('LLAMA_ARG_REUSE_PORT', '--reuse-port'),
    ('LLAMA_ARG_SSE_PING_INTERVAL', '--sse-ping-interval'),
    ('LLAMA_ARG_PERF', '--perf', '--no-perf'),
    ('LLAMA_ARG_DEFRAG_THOLD', '--defrag-thold'),
    ('LLAMA_ARG_CACHE_IDLE_SLOTS', '--cache-idle-slots', '--no-cache-idle-slots'),
    ('LLAMA_ARG_THREADS_HTTP', '--threads-http'),
    ('LLAMA_ARG_CACHE_PROMPT', '--cache-prompt', '--no-cache-prompt'),
    ('LLAMA_ARG_CACHE_REUSE', '--cache-reuse'),
    ('LLAMA_ARG_ENDPOINT_METRICS', '--metrics'),
    ('LLAMA_ARG_ENDPOINT_PROPS', '--props'),
    ('LLAMA_ARG_ENDPOINT_SLOTS', '--slots', '--no-slots'),
    ('LLAMA_ARG_MODELS_DIR', '--models-dir'),
    ('LLAMA_ARG_MODELS_PRESET', '--models-preset'),
    ('LLAMA_ARG_MODELS_MAX', '--models-max'),
    ('LLAMA_ARG_MODELS_AUTOLOAD', '--models-autoload', '--no-models-autoload'),
    ('LLAMA_ARG_JINJA', '--jinja', '--no-jinja'),
    ('LLAMA_ARG_THINK', '--reasoning-format'),
    ('LLAMA_ARG_REASONING', '--reasoning'),
    ('LLAMA_ARG_REASONING_EFFORT', '--reasoning-effort'),
    ('LLAMA_ARG_THINK_BUDGET', '--reasoning-budget'),
    ('LLAMA_ARG_THINK_BUDGET_MESSAGE', '--reasoning-budget-message'),
    ('LLAMA_ARG_CHAT_TEMPLATE', '--chat-template'),
    ('LLAMA_ARG_CHAT_TEMPLATE_FILE', '--chat-template-file'),
    ('LLAMA_ARG_LOG_COLORS', '--log-colors'),
    ('LLAMA_ARG_LOG_FILE', '--log-file'),
    ('LLAMA_ARG_OFFLINE', '--offline'),
    ('LLAMA_ARG_LOG_VERBOSITY', '--verbosity'),
    ('LLAMA_ARG_LOG_PREFIX', '--log-prefix', '--no-log-prefix'),
    ('LLAMA_ARG_LOG_TIMESTAMPS', '--log-timestamps', '--no-log-timestamps'),
    ('LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K', '--spec-draft-type-k'),
    ('LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V', '--spec-draft-type-v'),
    ('LLAMA_ARG_SPEC_DRAFT_N_MAX', '--spec-draft-n-max'),
    ('LLAMA_ARG_SPEC_DRAFT_N_MIN', '--spec-draft-n-min'),
    ('LLAMA_ARG_SPEC_DRAFT_P_MIN', '--spec-draft-p-min'),
    ('LLAMA_ARG_SPEC_DRAFT_MODEL', '--spec-draft-model'),
    ('LLAMA_ARG_SPEC_TYPE', '--spec-type'),
)


def env_argv(parser, argv, environ):
    """The flags ``environ``'s variables stand for, where ``argv`` does not give the same
    setting; ValueError naming a variable whose value a switch does not take."""
    given = set()
    for token in argv:
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        if action is not None:
            given.add(action.dest)
    out = []
    for env, flag, *negative in ENV:
        action = parser._option_string_actions[flag]
        value = environ.get(env)
        if negative and environ.get(env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)) is not None:
            value = "0"
        if value is None or action.dest in given:
            continue
        if action.nargs != 0 and not negative:
            out += [flag, value]
        elif value in TRUTHY:
            out.append(flag)
        elif negative and value in FALSEY:
            out.append(negative[0])
        elif negative:
            raise ValueError("$%s=%s: give 1, true, on or enabled, or 0, false, off or "
                             "disabled" % (env, value))
    return out
