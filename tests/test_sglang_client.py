"""The SGLang HTTP client against a loopback stub that behaves as SGLang's source says the server does
(tests/sglang_stub.py), including the ways a server can fail: hung, trickling, malformed, wrong ids."""

from __future__ import annotations

import sys
import time

import pytest
from sglang_stub import Stub, serve

from opd.errors import OpdError
from opd.rollout import SamplingParams, get_engine
from opd.rollout.sglang import SGLangEngine, health, launch_server

FAST = {"timeout_s": 1.0, "retries": 2, "backoff_s": 0.05}  # a stalled server costs 1 s, not 600


@pytest.fixture
def stub(tokenizer, pico_model):
    s = Stub(tokenizer("7\n", add_special_tokens=False).input_ids, pico_model.config.vocab_size)
    server = serve(s)
    s.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield s
    s.stop.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def engine(stub, tokenizer, pico_model):
    return get_engine("sglang", base_url=stub.url, tokenizer=tokenizer, model=pico_model, **FAST)


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


def test_score_sends_start_one_before_the_completion(engine, stub):
    scores = engine.score([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])
    path, body = stub.requests[-1]
    assert path == "/generate"
    assert body["input_ids"] == [[5, 6, 7, 9, 10], [8, 11, 12, 13]]
    assert body["sampling_params"]["max_new_tokens"] == 0
    # len(prompt) - 1: the server puts None at that position, so the completion's entries follow it.
    assert body["return_logprob"] is True and body["logprob_start_len"] == [2, 0]
    # The stub gives position p the log-prob -0.1 p: completion tokens sit at positions 3,4 and 1,2,3.
    assert scores[0] == pytest.approx([-0.3, -0.4]) and scores[1] == pytest.approx([-0.1, -0.2, -0.3])


def test_score_never_sends_an_empty_completion(engine, stub):
    n = len(stub.requests)
    assert engine.score([[5, 6]], [[]]) == [[]]
    assert len(stub.requests) == n  # nothing to ask
    scores = engine.score([[5, 6], [7], [8, 9]], [[], [10], []])
    assert scores[0] == [] and scores[2] == [] and scores[1] == pytest.approx([-0.1])
    assert stub.requests[-1][1]["input_ids"] == [[7, 10]]


def test_score_of_the_last_vocabulary_id(engine, stub):
    # The server reports input ids >= vocab_size - 1 as 0; the client must still line them up.
    last = stub.vocab_size - 1
    assert engine.score([[5]], [[last, 6]]) == [pytest.approx([-0.1, -0.2])]


def test_old_stub_semantics_would_be_caught(engine, stub):
    # A server answering None inside the completion (the bug this client once had, seen from the
    # other side) is refused in one line, not a TypeError.
    stub.faults = ["none_inside"]
    with pytest.raises(OpdError, match="hold None"):
        engine.score([[5, 6]], [[7, 8]])


def test_stub_aborts_a_start_past_the_input_when_generating(stub, engine):
    # What an older client sent (start = len(prompt)) with an empty completion and max_new_tokens > 0.
    with pytest.raises(OpdError, match="HTTP 400.*logprob_start_len"):
        engine._generate_request({"input_ids": [[5, 6]], "sampling_params": {"max_new_tokens": 1},
                                  "return_logprob": True, "logprob_start_len": [2]})


def test_misaligned_scores_refused(engine, stub):
    # A server answer one entry short must be refused rather than scored against the wrong tokens.
    original = stub.generate

    def shifted(body):
        code, res = original(body)
        for r in res:
            r["meta_info"]["input_token_logprobs"] = r["meta_info"]["input_token_logprobs"][1:]
        return code, res

    stub.generate = shifted
    with pytest.raises(OpdError, match="line up"):
        engine.score([[5, 6]], [[7, 8]])


def test_sync_weights_saves_then_updates(engine, stub, pico_model, tmp_path):
    engine.weights_dir = tmp_path / "policy"
    engine.sync_weights(pico_model)
    path, body = stub.requests[-1]
    assert path == "/update_weights_from_disk" and body == {"model_path": str(tmp_path / "policy")}
    assert (tmp_path / "policy" / "config.json").exists()
    engine.sync_weights(tmp_path / "elsewhere")
    assert stub.requests[-1][1] == {"model_path": str(tmp_path / "elsewhere")}
    stub.update_ok = False  # the real server answers HTTP 400 with the message
    with pytest.raises(OpdError, match=r"weight update from .*HTTP 400.*shapes do not match") as e:
        engine.sync_weights(tmp_path / "elsewhere")
    assert "\n" not in str(e.value)


def test_sync_weights_temp_copy_is_removed_with_the_client(stub, pico_model, tokenizer):
    """Without a weights_dir the policy is saved to a temp dir (a full model copy per client): it
    goes when the client does, not left in /tmp."""
    import gc

    from opd.rollout.sglang import SGLangEngine

    client = SGLangEngine(stub.url, tokenizer, model=pico_model)
    client.sync_weights(pico_model)
    d = client.weights_dir
    assert (d / "config.json").exists()
    del client
    gc.collect()
    assert not d.exists()


def test_errors_are_one_line_opd_errors(stub, tokenizer, engine):
    assert health(stub.url)
    with pytest.raises(OpdError, match="HTTP 400"):
        engine._generate_request({"input_ids": []})
    with pytest.raises(OpdError, match="HTTP 400.*unknown field `seed`"):
        engine._generate_request({"input_ids": [[5]], "sampling_params": {"seed": 1}})
    down = SGLangEngine("http://127.0.0.1:9", tokenizer, stop_ids=[1], **FAST)
    assert not health(down.base_url, timeout_s=1)
    with pytest.raises(OpdError, match="no answer after 3 tries.*Connection"):
        down.generate(["1+1="], n=1, params=SamplingParams())


def test_hung_server_hits_the_overall_deadline(engine, stub):
    stub.faults = ["hang"]
    t = time.monotonic()
    with pytest.raises(OpdError, match="no complete answer within 1 s"):
        engine.score([[5]], [[6]])
    assert time.monotonic() - t < 2.5


def test_trickling_server_hits_the_overall_deadline(engine, stub):
    # One byte every 50 ms never lets a per-read timeout fire; the call's deadline still does.
    stub.faults = ["trickle"]
    t = time.monotonic()
    with pytest.raises(OpdError, match="no complete answer within 1 s"):
        engine.generate(["1+6="], n=4, params=SamplingParams(max_new_tokens=5))
    assert time.monotonic() - t < 2.5


def test_malformed_and_oversized_answers(engine, stub):
    stub.faults = ["malformed"]
    with pytest.raises(OpdError, match="not JSON") as e:
        engine.score([[5]], [[6]])
    assert "\n" not in str(e.value)
    engine.http = type(engine.http)(**{**engine.http.__dict__, "max_response_bytes": 100})
    with pytest.raises(OpdError, match="exceeds max_response_bytes=100"):
        engine.generate(["1+6="], n=4, params=SamplingParams(max_new_tokens=5))


def test_bad_ids_and_overlong_samples_refused(engine, stub):
    stub.faults = ["bad_ids"]
    with pytest.raises(OpdError, match="outside the vocabulary"):
        engine.generate(["1+6="], n=1, params=SamplingParams(max_new_tokens=5))
    stub.faults = ["long"]
    with pytest.raises(OpdError, match="more than max_new_tokens=5"):
        engine.generate(["1+6="], n=1, params=SamplingParams(max_new_tokens=5))
    with pytest.raises(OpdError, match="score: input 0 has token id 99999"):
        engine.score([[5]], [[99999]])


def test_retries_on_503_and_dropped_connections(engine, stub):
    stub.faults = ["503", "drop"]
    assert engine.score([[5]], [[6]]) == [pytest.approx([-0.1])]
    assert [p for p, _ in stub.requests[-3:]] == ["/generate"] * 3
    stub.faults = ["503"] * 3
    with pytest.raises(OpdError, match="no answer after 3 tries.*HTTP 503"):
        engine.score([[5]], [[6]])


def test_api_key_sent_as_bearer(stub, tokenizer, pico_model, monkeypatch):
    stub.api_key = "sekrit"
    keyless = get_engine("sglang", base_url=stub.url, tokenizer=tokenizer, model=pico_model, **FAST)
    with pytest.raises(OpdError, match="HTTP 401.*api_key"):
        keyless.score([[5]], [[6]])
    keyed = get_engine("sglang", base_url=stub.url, tokenizer=tokenizer, model=pico_model, api_key="sekrit", **FAST)
    assert keyed.score([[5]], [[6]]) == [pytest.approx([-0.1])]
    assert stub.headers[-1]["Authorization"] == "Bearer sekrit"
    monkeypatch.setenv("OPD_SGLANG_API_KEY", "sekrit")  # for engines built elsewhere (OPD teachers)
    assert SGLangEngine(stub.url, tokenizer, model=pico_model, **FAST).score([[5]], [[6]])[0]


def test_health_is_503_while_starting(tokenizer, pico_model):
    s = Stub([5], pico_model.config.vocab_size, starting_s=0.2)
    server = serve(s)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert not health(url)
        time.sleep(0.3)
        assert health(url)
    finally:
        server.shutdown()
        server.server_close()


def test_launch_server_waits_and_sets_original_logprob_env(tmp_path, monkeypatch):
    # A fake interpreter that runs the stub stands in for `python -m sglang.launch_server`.
    import json
    import socket
    import urllib.request
    from pathlib import Path

    fake = tmp_path / "fakepython"
    stub_py = Path(__file__).with_name("sglang_stub.py")
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {stub_py} \"$@\"\n")
    fake.chmod(0o755)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("STUB_STARTING_S", "0.3")
    with launch_server(tmp_path, port, python=str(fake), timeout_s=20) as server:
        with urllib.request.urlopen(f"{server.base_url}/stub_env", timeout=5) as resp:
            env = json.loads(resp.read())
    assert env == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "RETURN_ORIGINAL_LOGPROB": "1"}
    assert server.process.poll() is not None  # closed on leaving the block


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
