#!/usr/bin/env python3
"""Record llama-server's /apply-template output for every pinned chat template.

    python3 scripts/make_chat_goldens.py [--server PATH] [--model GGUF] [--only NAME]

For each models/templates/*.jinja of the pinned llama.cpp source this starts
the pinned llama-server (``--jinja --chat-template-file T``, loopback only)
with a small model, posts the message lists of CASES to /apply-template, and
writes what came back -- the prompt or the error -- with the template's caps
(from /props) to tests/golden/chat/<template>.json; the requests themselves go
to tests/golden/chat_cases.json.  tests/test_chat_templates.py
renders the same cases with offgrid's interpreter and compares, so `make test`
never needs llama-server.

llama-server comes from `bash scripts/build_lib.sh --server` (cached under
~/.cache/offgrid/llama-server-*/bin); the model's BOS/EOS tokens are part of
the output (templates print bos_token, and a leading BOS is removed when the
model adds its own), so the goldens record which model made them.  Templates
that print the date get today's date: each case records the time it was
asked at, and the test renders with that time.
"""

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("OFFGRID_CACHE") or os.path.expanduser("~/.cache/offgrid"))
OUT = ROOT / "tests" / "golden" / "chat"              # one file per template
CASES_FILE = ROOT / "tests" / "golden" / "chat_cases.json"     # the requests, once

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
# Mistral templates insist on 9-character alphanumeric call ids
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL2 = {"id": "call00002", "type": "function",
         "function": {"name": "get_time", "arguments": '{"timezone": "Europe/Paris"}'}}

CASES = {
    "system_user": {"messages": [SYSTEM, {"role": "user", "content": "Hello! How are you?"}]},
    "user_only": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    "no_generation_prompt": {"messages": [SYSTEM, {"role": "user", "content": "Hi"}],
                             "add_generation_prompt": False},
    "multi_turn": {"messages": [
        SYSTEM, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke."}]},
    "text_parts": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]},
    "thinking_on": {"messages": [{"role": "user", "content": "Why is the sky blue?"}],
                    "chat_template_kwargs": {"enable_thinking": True}},
    "thinking_off": {"messages": [{"role": "user", "content": "Why is the sky blue?"}],
                     "chat_template_kwargs": {"enable_thinking": False}},
    "tools": {"messages": [SYSTEM, {"role": "user", "content": "What's the weather in Paris?"}],
              "tools": [WEATHER, TIME]},
    "tool_results": {"messages": [
        SYSTEM, {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call00001", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
        {"role": "user", "content": "Thanks! And the time there?"}],
        "tools": [WEATHER, TIME]},
    "parallel_tool_results": {"messages": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, CALL2]},
        {"role": "tool", "tool_call_id": "call00001", "content": '{"temperature": 21}'},
        {"role": "tool", "tool_call_id": "call00002", "content": "14:05"}],
        "tools": [WEATHER, TIME]},
    "reasoning_history": {"messages": [
        {"role": "user", "content": "What is 3*7?"},
        {"role": "assistant", "content": "21.", "reasoning_content": "3 times 7 is 21."},
        {"role": "user", "content": "And 3*8?"}]},
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_server(given):
    if given:
        return Path(given)
    found = sorted(glob.glob(str(CACHE / "llama-server-*" / "bin" / "llama-server")))
    if not found:
        sys.exit("llama-server not found under %s; build it with "
                 "`bash scripts/build_lib.sh --server` or pass --server" % CACHE)
    return Path(found[-1])


def request(port, method, path, body=None, timeout=60):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                 method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def record(server, model, template):
    port = free_port()
    cmd = [str(server), "-m", str(model), "--jinja", "--chat-template-file", str(template),
           "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "1", "-t", "2",
           "-ngl", "0", "--no-webui"]
    log = open(os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read()
                return {"server_error": err.strip().splitlines()[-5:]}
            try:
                status, body = request(port, "GET", "/health", timeout=2)
                if status == 200:
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start for %s" % template.name)
            time.sleep(0.2)
        _, props = request(port, "GET", "/props")
        out = {"caps": props.get("chat_template_caps", {}),
               "bos_token": props.get("bos_token"), "eos_token": props.get("eos_token"),
               "cases": {}}
        for name, body in CASES.items():
            now = time.time()
            status, resp = request(port, "POST", "/apply-template", body)
            case = {"now": now, "status": status}
            if status == 200:
                case["prompt"] = resp["prompt"]
            else:
                case["error"] = resp.get("error", {}).get("message", str(resp))
            out["cases"][name] = case
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", help="llama-server binary (default: the cached build)")
    p.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--templates", default=str(CACHE / "llama.cpp" / "models" / "templates"))
    p.add_argument("--only", help="only templates whose file name contains this")
    args = p.parse_args()
    server = find_server(args.server)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(CASES_FILE, "w", encoding="utf-8") as fh:
        json.dump(CASES, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    templates = sorted(Path(args.templates).glob("*.jinja"))
    if args.only:
        templates = [t for t in templates if args.only in t.name]
    for t in templates:
        rec = record(server, args.model, t)
        rec = dict({"template": t.name, "model": Path(args.model).name}, **rec)
        with open(OUT / (t.stem + ".json"), "w", encoding="utf-8") as fh:
            json.dump(rec, fh, indent=1, ensure_ascii=False, sort_keys=False)
            fh.write("\n")
        n_ok = sum(1 for c in rec.get("cases", {}).values() if "prompt" in c)
        print("%-60s %s" % (t.name, "%d/%d cases rendered" % (n_ok, len(CASES))
                            if "cases" in rec else "server failed"), flush=True)


if __name__ == "__main__":
    main()
