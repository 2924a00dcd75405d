"""The SGLang HTTP client against a loopback stub that speaks the server's native API shapes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from opd.errors import OpdError
from opd.rollout import SamplingParams, get_engine
from opd.rollout.sglang import SGLangEngine, health, launch_server


class Stub:
    """Canned answers: each generated completion is "7\\n" (logprobs -0.5, -0.25); scoring gives
    -0.1 * (position) for every input token from logprob_start_len on, with None at position 0."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.requests: list[tuple[str, dict]] = []
        self.update_ok = True

    def generate(self, body: dict) -> list[dict]:
        out = []
        starts = body.get("logprob_start_len", -1)
        for k, ids in enumerate(body["input_ids"]):
            meta = {"prompt_tokens": len(ids), "finish_reason": {"type": "stop"}}
            if body["sampling_params"]["max_new_tokens"] == 0:
                start = starts[k] if isinstance(starts, list) else starts
                meta["input_token_logprobs"] = [
                    [None if p == 0 else -0.1 * p, t, None] for p, t in enumerate(ids) if p >= start
                ]
                meta["output_token_logprobs"] = []
                out.append({"text": "", "output_ids": [], "meta_info": meta})
            else:
                gen = self.tok("7\n", add_special_tokens=False).input_ids
                meta["output_token_logprobs"] = [[-0.5, gen[0], None], [-0.25, gen[1], None]]
                out.append({"text": "7", "output_ids": gen, "meta_info": meta})
        return out


def _serve(stub: Stub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {}) if self.path == "/health" else self._send(404, {"error": "no"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            stub.requests.append((self.path, body))
            if self.path == "/generate":
                if not body.get("input_ids"):
                    self._send(400, {"error": {"message": "input_ids required"}})
                else:
                    self._send(200, stub.generate(body))
            elif self.path == "/update_weights_from_disk":
                self._send(200, {"success": stub.update_ok, "message": "ok" if stub.update_ok else "bad shapes"})
            else:
                self._send(404, {"error": "not found"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def stub(tokenizer):
    s = Stub(tokenizer)
    server = _serve(s)
    s.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield s
    server.shutdown()
    server.server_close()


@pytest.fixture
def engine(stub, tokenizer, pico_model):
    return get_engine("sglang", base_url=stub.url, tokenizer=tokenizer, model=pico_model, timeout_s=5)


def test_generate_payload_and_parsing(engine, stub, tokenizer):
    out = engine.generate(["1+6=", "3+4="], n=2, params=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5))
    path, body = stub.requests[-1]
    assert path == "/generate"
    p0 = tokenizer("1+6=", add_special_tokens=False).input_ids
    p1 = tokenizer("3+4=", add_special_tokens=False).input_ids
    assert body["input_ids"] == [p0, p0, p1, p1]  # prompt-major, n copies each
    nl = tokenizer.convert_tokens_to_ids("\n")
    assert body["sampling_params"] == {
        "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 5,
        "stop_token_ids": [nl, tokenizer.eos_token_id], "no_stop_trim": True, "skip_special_tokens": False,
    }
    assert body["return_logprob"] is True
    assert [len(g) for g in out] == [2, 2]
    r = out[1][0]
    assert r.prompt == "3+4=" and r.prompt_ids == p1
    assert r.completion_ids == tokenizer("7\n", add_special_tokens=False).input_ids
    assert r.text == "7\n" and r.logprobs == [-0.5, -0.25]


def test_score_payload_and_alignment(engine, stub):
    scores = engine.score([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])
    path, body = stub.requests[-1]
    assert path == "/generate"
    assert body["input_ids"] == [[5, 6, 7, 9, 10], [8, 11, 12, 13]]
    assert body["sampling_params"]["max_new_tokens"] == 0
    assert body["return_logprob"] is True and body["logprob_start_len"] == [3, 1]
    # The stub gives position p the logprob -0.1 p: completion tokens sit at positions 3,4 and 1,2,3.
    assert scores[0] == pytest.approx([-0.3, -0.4]) and scores[1] == pytest.approx([-0.1, -0.2, -0.3])


def test_sync_weights_saves_then_updates(engine, stub, pico_model, tmp_path):
    engine.weights_dir = tmp_path / "policy"
    engine.sync_weights(pico_model)
    path, body = stub.requests[-1]
    assert path == "/update_weights_from_disk" and body == {"model_path": str(tmp_path / "policy")}
    assert (tmp_path / "policy" / "config.json").exists()
    engine.sync_weights(tmp_path / "elsewhere")
    assert stub.requests[-1][1] == {"model_path": str(tmp_path / "elsewhere")}
    stub.update_ok = False
    with pytest.raises(OpdError, match="bad shapes"):
        engine.sync_weights(tmp_path / "elsewhere")


def test_errors_are_one_line_opd_errors(stub, tokenizer, engine):
    assert health(stub.url)
    with pytest.raises(OpdError, match="HTTP 400"):
        engine._generate_request({"input_ids": []})
    down = SGLangEngine("http://127.0.0.1:9", tokenizer, stop_ids=[1], timeout_s=2)
    assert not health(down.base_url, timeout_s=1)
    with pytest.raises(OpdError, match="unreachable"):
        down.generate(["1+1="], n=1, params=SamplingParams())


def test_misaligned_scores_refused(engine, stub):
    # A server answer one entry short must be refused rather than scored against the wrong tokens.
    original = stub.generate

    def shifted(body):
        res = original(body)
        for r in res:
            r["meta_info"]["input_token_logprobs"] = r["meta_info"]["input_token_logprobs"][1:]
        return res

    stub.generate = shifted
    with pytest.raises(OpdError, match="line up"):
        engine.score([[5, 6]], [[7, 8]])


def test_launch_server_without_sglang(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(OpdError, match="sglang is not installed"):
        launch_server(tmp_path, port=30000)


def test_launch_server_reports_early_exit(tmp_path):
    # An interpreter that exits at once stands in for a server that crashes on start.
    fake = tmp_path / "fakepython"
    fake.write_text("#!/bin/sh\necho 'no CUDA device' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(OpdError, match=r"exited with code 3.*no CUDA device"):
        launch_server(tmp_path, port=30000, python=str(fake), timeout_s=20)
