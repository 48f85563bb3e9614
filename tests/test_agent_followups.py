"""An agent's loop ends with an answer on the default model (issue 48).

openai-agents and `llm` (test-only dependencies) run their own loops over
/v1/chat/completions: the call, the tool's result, then the answer.
Qwen2.5-Coder-0.5B writes the same call again after the result, as bare
JSON; the tool-call rescue leaves a call identical to a finished one as the
model's text, so the run ends with an answer instead of MaxTurnsExceeded.
The Node `openai` package's loop (the SDK Node agents are built on) is the
same, with the follow-up streamed as agents stream it; it needs an npm
package (scripts/node_openai.sh), so it runs in `make test-agents`.
(LangChain's follow-up is test_ollama.py's.)
"""

import json
import subprocess

import pytest

try:
    from .conftest import QWEN
    from .serverproc import ROOT, ServerProcess
except ImportError:
    from conftest import QWEN
    from serverproc import ROOT, ServerProcess

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


# The agent's loop with the Node SDK: the call, the tool's result, then the
# answer, streamed (content and tool-call deltas accumulated as agents do).
NODE_LOOP = r"""
const { OpenAI } = require("openai");
const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: "none", maxRetries: 0 });
const model = process.env.MODEL;
const tools = [{ type: "function", function: {
  name: "get_weather", description: "The current weather in a city.",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } }];
const messages = [{ role: "user", content: "What is the weather in Paris?" }];
(async () => {
  const first = await client.chat.completions.create(
    { model, messages, tools, temperature: 0, max_tokens: 60 });
  const call = first.choices[0].message;
  messages.push(call);
  for (const c of call.tool_calls || [])
    messages.push({ role: "tool", tool_call_id: c.id, content: "Sunny, 21 C" });
  const stream = await client.chat.completions.create(
    { model, messages, tools, temperature: 0, max_tokens: 60, stream: true });
  let content = "", calls = [], finish = null;
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    content += choice.delta.content || "";
    for (const tc of choice.delta.tool_calls || []) calls.push(tc);
    finish = choice.finish_reason || finish;
  }
  console.log(JSON.stringify({ call, answer: { content, calls, finish } }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_openai():
    """The folder whose node_modules has the openai package (installed once, cached)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "node_openai.sh")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, "scripts/node_openai.sh failed:\n" + out.stderr
    return out.stdout.strip()


@pytest.mark.agents
def test_the_node_openai_follow_up_after_a_tool_result_ends_with_an_answer(srv, node_openai,
                                                                           tmp_path):
    import os
    script = tmp_path / "loop.js"
    script.write_text(NODE_LOOP)
    env = dict(os.environ, BASE_URL=srv.base + "/v1", MODEL=QWEN.name,
               NODE_PATH=os.path.join(node_openai, "node_modules"))
    r = subprocess.run(["node", str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (call,) = out["call"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and \
        json.loads(call["function"]["arguments"]) == {"city": "Paris"}, out["call"]
    answer = out["answer"]
    assert answer["content"].strip() and not answer["calls"] and answer["finish"] == "stop", answer
