"""The real agent CLIs against `ninfer serve` on loopback, in their default configuration (all their tools,
their own model names, their own requests): each completes a turn with one shell tool call.

The model is scripted (a random tiny model never calls a tool): the engine under the real scheduler and app
reads the rendered prompt and plays back a tool call, or, once the tool's output is in the prompt, the final
answer. Opt-in, as the CLIs are npm packages that .ci/run does not install:

    npm install --prefix ~/agents @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332
    NINFER_AGENT_CLIS=~/agents/node_modules/.bin python -m pytest -n0 tests/test_agent_clients.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from format.tiny import CHAT_TEMPLATE, build_tokenizer
from runtime.serve.app import Server, ServerConfig, build_app
from runtime.serve.chat_template import ChatTemplate
from runtime.serve.scheduler import Scheduler

from .serving import Loopback
from .test_serve_hardening import VOCAB, FakeEngine

BIN = os.environ.get("NINFER_AGENT_CLIS")
needs_clis = pytest.mark.skipif(not BIN, reason="opt-in: set NINFER_AGENT_CLIS to a folder with the codex and claude "
                                "executables (see this module's docstring)")
MARKER = "NINFER_TOOL_RAN_42"
ASK = f"Run the shell command `echo {MARKER}` and tell me what it printed."


def call(name: str, **arguments) -> str:
    """A tool call in the qwen3_coder format the server parses (values typed by the tool's schema)."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def shell_call(prompt: str) -> str:
    """The client's own shell tool, called the way its schema asks (found in the rendered tool list)."""
    tools = {m.group(1) for m in re.finditer(r'"name": "([A-Za-z_][A-Za-z0-9_.-]*)"', prompt)}
    if "run_shell" in tools:  # the Agents SDK test's own function tool
        return call("run_shell", command=f"echo {MARKER}")
    if "Bash" in tools:  # Claude Code
        return call("Bash", command=f"echo {MARKER}", description="Print the marker")
    if "exec" in tools and "tools.exec_command" in prompt:  # Codex: a freeform JavaScript tool over its nested tools
        return call("exec", input=f'const r = await tools.exec_command({{cmd: "echo {MARKER}"}});\ntext(r);')
    if "exec_command" in tools:  # Codex (unified exec)
        return call("exec_command", cmd=f"echo {MARKER}")
    if "shell_command" in tools:
        return call("shell_command", command=f"echo {MARKER}")
    if "shell" in tools:
        return call("shell", command=["bash", "-lc", f"echo {MARKER}"])
    raise AssertionError(f"no shell tool among the client's tools: {sorted(tools)}")


def reply_for(prompt: str) -> str:
    """What the scripted model answers: the call, then (its output in the prompt) the answer; other
    requests the clients make on the side (titles, summaries) get a short text. A prompt that opens a
    thinking block gets a short one, closed."""
    thought = "Short thought.\n</think>\n\n" if prompt.rstrip().endswith("<think>") else ""
    return thought + _answer(prompt)


def output_seen(prompt: str) -> bool:
    """The marker appears other than in `echo MARKER` (the task and the call): the command's output is back."""
    return prompt.count(MARKER) > prompt.count(f"echo {MARKER}")


def _answer(prompt: str) -> str:
    asked = ASK in prompt
    if asked and output_seen(prompt):
        return f"The command printed {MARKER}."
    if asked:
        return "I will run it.\n\n" + shell_call(prompt)
    return "Shell marker check"


class ScriptedEngine(FakeEngine):
    """The fake engine of the serve tests, each lane playing back reply_for(its prompt)."""

    def __init__(self, tokenizer, lanes: int = 2):
        super().__init__(tokenizer, lanes, step_s=0.001)
        self.tokenizer = tokenizer
        self.opts = SimpleNamespace(max_context=1 << 21)  # the clients' prompts are long in this small vocabulary
        self.script: dict[int, list[int]] = {}
        self.prompts: list[str] = []

    def one_hot(self, token: int) -> torch.Tensor:
        out = torch.full((VOCAB,), -1e4)  # the scripted token whatever the client's sampling settings
        out[token] = 0.0
        return out

    def prefill_chunks(self, lane, prompt, **_):
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        self.prompts.append(text)
        self.script[lane] = self.tokenizer.encode(reply_for(text), add_special_tokens=False).ids + [self.stop]
        self.held[lane] = len(prompt)

        def chunks():
            yield self.one_hot(self.script[lane].pop(0))

        return chunks()

    def decode_step(self, lanes, tokens, device_tokens=None):
        time.sleep(0.001)
        rows = []
        for lane in lanes:
            self.held[lane] += 1
            script = self.script.get(lane) or [self.stop]
            rows.append(self.one_hot(script.pop(0)))
        return torch.stack(rows)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = build_tokenizer(VOCAB)
    engine = ScriptedEngine(tok)
    scheduler = Scheduler(engine)
    log = tmp_path_factory.mktemp("agents") / "requests.jsonl"
    config = ServerConfig("tiny", 1 << 21, accept_any_model=True, request_log=str(log))
    server = Server(engine, tok, ChatTemplate(CHAT_TEMPLATE), config, {engine.stop}, scheduler)
    loopback = Loopback(build_app(server))
    yield SimpleNamespace(url=loopback.url, engine=engine, log=log)
    loopback.stop()
    scheduler.close()


def _run(argv: list[str], env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    home = cwd / "home"
    home.mkdir(exist_ok=True)
    full = {"PATH": os.environ["PATH"], "HOME": str(home), "NO_COLOR": "1", **env}
    return subprocess.run(argv, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _assert_turn(served, result, since: int):
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    prompts = served.engine.prompts[since:]
    assert any(ASK in p for p in prompts), "the client never sent the task"
    followed = [p for p in prompts if ASK in p and output_seen(p)]
    assert followed, "the tool's output never came back to the server"
    assert f"The command printed {MARKER}" in out, out[-3000:]


@needs_clis
def test_codex_cli_completes_a_turn_with_a_shell_call(served, tmp_path):
    """Codex (Responses wire API; its tools arrive as `additional_tools` input items, its shell behind the
    freeform `exec` tool) with a provider entry for the server: its own model name and tools."""
    since = len(served.engine.prompts)
    provider = f'{{name="ninfer",base_url="{served.url}/v1",wire_api="responses",env_key="NINFER_API_KEY"}}'
    result = _run([str(Path(BIN) / "codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                   "-c", f"model_providers.ninfer={provider}", "-c", "model_provider=ninfer", ASK],
                  {"NINFER_API_KEY": "sk-local"}, tmp_path)
    _assert_turn(served, result, since)


@needs_clis
def test_claude_code_completes_a_turn_with_a_shell_call(served, tmp_path):
    """Claude Code (Messages API) with ANTHROPIC_BASE_URL: its own model names, all its tools."""
    since = len(served.engine.prompts)
    result = _run([str(Path(BIN) / "claude"), "-p", ASK, "--allowedTools", "Bash"],
                  {"ANTHROPIC_BASE_URL": served.url, "ANTHROPIC_API_KEY": "sk-local", "DISABLE_AUTOUPDATER": "1",
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, tmp_path)
    _assert_turn(served, result, since)


def test_openai_agents_sdk_turn_with_auto_previous_response_id(served):
    """The OpenAI Agents SDK over the Responses API, each turn chained by previous_response_id (only the
    tool's output is sent the second time): the server recalls the conversation and the run finishes."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def run_shell(command: str) -> str:
        """Run a shell command and return what it printed."""
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30).stdout

    model = agents.OpenAIResponsesModel(model="gpt-5-agent", openai_client=AsyncOpenAI(base_url=served.url + "/v1",
                                                                                    api_key="sk-local", max_retries=0))
    agent = agents.Agent(name="shell", instructions="Use run_shell for shell commands.", tools=[run_shell], model=model)
    since = len(served.engine.prompts)
    result = agents.Runner.run_sync(agent, ASK, auto_previous_response_id=True)
    assert result.final_output == f"The command printed {MARKER}."
    chained = [p for p in served.engine.prompts[since:] if ASK in p and output_seen(p)]
    assert chained, "the second turn did not carry the conversation through previous_response_id"


def test_responses_custom_tools_sent_as_additional_tools(served):
    """The Codex CLI's request shape without the CLI: tools inside an `additional_tools` input item, a
    freeform (custom) tool in a namespace; the call comes back as a custom_tool_call with the raw input
    (streamed too), and the custom_tool_call / custom_tool_call_output items of the next turn are read."""
    import openai

    exec_tool = {"type": "custom", "name": "exec", "description": "Run JavaScript; nested tools: `tools.exec_command`.",
                 "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[\\s\\S]+/"}}
    tools_item = {"type": "additional_tools", "role": "developer",
                  "tools": [{"type": "namespace", "name": "functions", "description": "", "tools": [exec_tool]}]}
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}
    first = client.responses.create(model="codex-model", input=[tools_item, ask], reasoning={"effort": "none"})
    calls = [item for item in first.output if item.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "exec" and "tools.exec_command" in calls[0].input
    with client.responses.stream(model="codex-model", input=[tools_item, ask], reasoning={"effort": "none"}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.custom_tool_call_input.done" in kinds
    assert [item.input for item in streamed.output if item.type == "custom_tool_call"] == [calls[0].input]
    result = {"type": "custom_tool_call_output", "call_id": calls[0].call_id,
              "output": [{"type": "input_text", "text": MARKER + "\n"}]}
    second = client.responses.create(model="codex-model", reasoning={"effort": "none"}, input=[
        tools_item, ask, {"type": "custom_tool_call", "call_id": calls[0].call_id, "name": "exec", "input": calls[0].input},
        result])
    assert second.output_text == f"The command printed {MARKER}."
