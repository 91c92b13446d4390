"""`ninfer serve` as a process, as a supervisor sees it: a taken port fails in a moment with one line
(before any weights load), and SIGTERM with a request in flight lets it finish, then exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("triton")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(art, port, log, *extra):
    """The server as a process; its output goes to the file `log` (a pipe nobody reads could fill and
    block it)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "ninfer_cli.main", "serve", str(art), "--device", "cpu", "--port",
                             str(port), "--max-context", "256", "--prefill-chunk", "128", *extra],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture(scope="module")
def artifact(tiny_with_mtp, tmp_path_factory):
    from format.convert import ConvertOptions, convert_checkpoint

    return convert_checkpoint(tiny_with_mtp, tmp_path_factory.mktemp("proc") / "tiny.nfer",
                              ConvertOptions(recipe="q4", mtp=False)).output


def test_a_taken_port_fails_fast_with_one_line(artifact, tmp_path):
    with socket.socket() as holder, open(tmp_path / "serve.log", "w+") as log:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        t0 = time.time()
        proc = _serve(artifact, port, log)
        proc.wait(timeout=120)
        log.seek(0)
        err = log.read()
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], err
    assert time.time() - t0 < 60  # no model was loaded (the import of torch dominates)


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(artifact, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = _serve(artifact, port, log, "--shutdown-grace-s", "120")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True,
                "chat_template_kwargs": {"enable_thinking": False}}
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and not lines:
                    proc.send_signal(signal.SIGTERM)  # the request holds a lane: shut down now
                lines.append(line)
        assert [line for line in lines if line][-1] == "data: [DONE]"  # finished, not cut off
        code = proc.wait(timeout=240)
        log.seek(0)
        assert code == 0, log.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
