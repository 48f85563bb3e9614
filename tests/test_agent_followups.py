"""An agent's loop ends with an answer on the default model (issue 48).

openai-agents and `llm` (test-only dependencies) run their own loops over
/v1/chat/completions: the call, the tool's result, then the answer.
Qwen2.5-Coder-0.5B writes the same call again after the result, as bare
JSON; the tool-call rescue leaves a call identical to a finished one as the
model's text, so the run ends with an answer instead of MaxTurnsExceeded.
(LangChain's follow-up is test_ollama.py's.)
"""

import pytest

try:
    from .conftest import QWEN
    from .serverproc import ServerProcess
except ImportError:
    from conftest import QWEN
    from serverproc import ServerProcess

@pytest.fixture(scope="module")
def srv():
    with ServerProcess(QWEN, threads=1, ctx=4096) as s:
        yield s


def test_an_openai_agents_run_with_a_tool_ends_with_an_answer(srv):
    from openai import AsyncOpenAI
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner,
                        function_tool, set_tracing_disabled)
    set_tracing_disabled(True)
    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return "Sunny, 21 C"

    model = OpenAIChatCompletionsModel(
        model=QWEN.name, openai_client=AsyncOpenAI(base_url=srv.base + "/v1", api_key="none",
                                                   max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the tool's help.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert called and result.final_output.strip(), (called, result.final_output)


def test_llms_tool_chain_runs_the_tool_once_and_ends(srv, tmp_path):
    """Simon Willison's ``llm`` (test-only): its --functions chain calls the
    tool, sends the result, and ends: the model's repeat of the same call is
    its text, not a second run of the tool."""
    import os
    import subprocess
    import sys
    (tmp_path / "extra-openai-models.yaml").write_text(
        "- model_id: offgrid\n  model_name: %s\n  api_base: %s/v1\n  supports_tools: true\n"
        % (QWEN.name, srv.base))
    tool = 'def get_weather(city: str) -> str:\n    "The current weather in a city."\n' \
           '    return "Sunny, 21 C"\n'
    llm = os.path.join(os.path.dirname(sys.executable), "llm")
    r = subprocess.run([llm, "-m", "offgrid", "-o", "temperature", "0", "-o", "max_tokens", "60",
                        "--functions", tool, "--td", "What is the weather in Paris?"],
                       env=dict(os.environ, LLM_USER_PATH=str(tmp_path), OPENAI_API_KEY="none"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("Tool call: get_weather") == 1 and r.stdout.strip(), (r.stdout, r.stderr)
