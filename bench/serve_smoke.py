"""GPU smoke of the user paths on a tiny model: `ninfer serve` on cuda (text, image, streamed tool call,
MTP speculation) and `generate --vision --image`. Prints one line per check; exits 1 on a failure.

    PYTHONPATH=. python bench/serve_smoke.py WORKDIR
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
DEVICE = os.environ.get("NINFER_SMOKE_DEVICE", "cuda")


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:  # report the server's error body instead of a client traceback
        body = err.read().decode()
        print(f"HTTP {err.code}: {body[:800]}", flush=True)
        return err.code, json.dumps({"usage": {}, "error": body})


def _serve(artifact, **plan):
    import uvicorn

    from runtime.memory_plan import PlanOptions
    from runtime.serve.launch import build_server

    app, summary = build_server(artifact, PlanOptions(max_context=1024, max_concurrency=2, prefill_chunk=256, **plan),
                                device=DEVICE, model_id="tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{port}", summary


def main(work: str) -> None:
    import conftest
    from PIL import Image

    from format.convert import ConvertOptions, convert_checkpoint
    from format.tiny import write_tiny_checkpoint

    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    conftest._hf_checkpoint(w / "hf", moe=False)
    vis = convert_checkpoint(w / "hf", w / "vision.nfer", ConvertOptions(recipe="q4")).output
    write_tiny_checkpoint(w / "mtp_src", moe=False, seed=1)
    mtp = convert_checkpoint(w / "mtp_src", w / "mtp.nfer", ConvertOptions(recipe="q4")).output
    failures = 0

    def check(name, ok, detail=""):
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)

    buf = io.BytesIO()
    Image.new("RGB", (64, 40), (200, 30, 30)).save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    srv, url, summary = _serve(vis, vision=True)
    print(summary)
    text = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hello"}]}
    st, body = _post(url + "/v1/chat/completions", text)
    check("chat text on cuda", st == 200, json.loads(body)["usage"])
    img = dict(text, messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                             {"type": "image_url", "image_url": {"url": data_url}}]}])
    st, body = _post(url + "/v1/chat/completions", img)
    usage = json.loads(body)["usage"]
    check("chat image on cuda", st == 200 and usage.get("prompt_tokens", 0) > 20, usage)
    anth = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data_url.split(",", 1)[1]}},
        {"type": "text", "text": "describe"}]}]}
    st, body = _post(url + "/v1/messages", anth)
    check("anthropic image on cuda", st == 200, json.loads(body)["usage"])
    srv.should_exit = True
    srv, url, summary = _serve(mtp, spec="mtp", draft_tokens=3)
    print(summary)
    st, body = _post(url + "/v1/chat/completions", dict(text, max_tokens=24))
    check("chat with --spec mtp on cuda", st == 200, json.loads(body)["usage"])
    st, body = _post(url + "/v1/chat/completions", dict(text, max_tokens=16, stream=True))
    check("streamed chat with --spec mtp", st == 200 and body.rstrip().endswith("data: [DONE]"), f"{len(body)} bytes")
    st, body = _post(url + "/v1/chat/completions", dict(text, max_tokens=12, thinking_budget=3))
    usage = json.loads(body).get("usage", {})
    check("thinking budget with --spec mtp", st == 200 and usage["completion_tokens_details"]["reasoning_tokens"] <= 3, usage)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    st, body = _post(url + "/v1/chat/completions", dict(text, max_tokens=40, tools=tools, tool_choice="required",
                                                        chat_template_kwargs={"enable_thinking": False}))
    calls = json.loads(body)["choices"][0]["message"].get("tool_calls") or [] if st == 200 else []
    check("tool_choice required on cuda", st == 200 and [c["function"]["name"] for c in calls] == ["get_time"], body[:200])
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    st, body = _post(url + "/v1/chat/completions", dict(text, max_tokens=40, chat_template_kwargs={"enable_thinking": False},
                                                        response_format={"type": "json_schema", "json_schema": {
                                                            "name": "a", "schema": schema}}))
    content = json.loads(body)["choices"][0]["message"]["content"] if st == 200 else ""
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    check("structured output (json_schema) on cuda", isinstance(parsed, dict) and parsed.get("answer") in ("yes", "no"),
          content[:120])
    srv.should_exit = True
    # decode rows riding a long prompt's shared chunks through the server, on cuda (CUDA graphs)
    srv, url, summary = _serve(mtp, shared_prefill_chunk=128)
    print(summary)
    results = {}

    def ask(key, body):
        results[key] = _post(url + "/v1/chat/completions", body)

    alone = _post(url + "/v1/chat/completions", dict(text, max_tokens=300, chat_template_kwargs={"enable_thinking": False}))
    decoder = threading.Thread(target=ask, args=("short", dict(text, max_tokens=300,
                                                               chat_template_kwargs={"enable_thinking": False})))
    decoder.start()
    time.sleep(0.3)
    long_prompt = " ".join(f"word{i}" for i in range(150))
    ask("long", dict(text, max_tokens=4, messages=[{"role": "user", "content": long_prompt}]))
    decoder.join()
    same = results["short"][0] == 200 and alone[0] == 200 and \
        json.loads(results["short"][1])["choices"][0]["message"]["content"] == json.loads(alone[1])["choices"][0]["message"]["content"]
    check("a decoding lane beside a long prompt answers as alone", same and results["long"][0] == 200)
    srv.should_exit = True
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main(sys.argv[1])
