"""An agent's loop ends with an answer on the default model (issue 48).

openai-agents (a test-only dependency) runs its own loop over
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
