"""A loopback stand-in for an SGLang server, written from SGLang's source so that the client meets the
server's real semantics. Each behaviour names the SGLang file it copies (read in the 0.5.3, 0.5.6 and
0.5.23 wheels from PyPI and in sgl-project/sglang on GitHub); `faults` are test-only misbehaviours.

In process: `serve(Stub(...))`. As a process (what `launch_server` starts through a fake python):
`python tests/sglang_stub.py -m sglang.launch_server --model-path M --host H --port P`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The /generate body's sampling_params: unknown keys are refused with HTTP 400
# (python/sglang/api/v1/api_types.py `SamplingParams`, "unknown keys rejected", enforced by
# python/sglang/srt/entrypoints/api_contract.py in 0.5.23; older servers fail SamplingParams(**d)).
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}
ORIGINAL_LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")


class Stub:
    """Canned model: a generated completion is `gen_ids` with log-probs -0.5, -0.25, ...; the input
    token at position p (p >= 1) has log-prob -0.1 * p given the tokens before it.

    vocab_size: the served model's. starting_s: /health answers 503 for this long after start.
    api_key: as `--api-key`. update_ok: whether /update_weights_from_disk succeeds.
    faults: test-only misbehaviours, one per request taken in turn: "hang", "trickle", "malformed",
    "bad_ids", "long", "503", "drop", "none_inside", "short_top".
    model: a causal LM whose log-probs the top-k input log-probs (`top_logprobs_num`) report; without
    one, the top k at every position are ids 0..k-1 with log-probs -1, -2, ...
    """

    def __init__(self, gen_ids: list[int], vocab_size: int, starting_s: float = 0.0, api_key: str | None = None,
                 model=None):
        self.gen_ids = list(gen_ids)
        self.vocab_size = vocab_size
        self.started = time.monotonic()
        self.starting_s = starting_s
        self.api_key = api_key
        self.update_ok = True
        self.faults: list[str] = []
        self.requests: list[tuple[str, dict]] = []
        self.headers: list[dict] = []
        self.stop = threading.Event()
        self.model = model

    def top_at(self, ids: list[int], k: int) -> list[list]:
        """The top k [logprob, token_id, None] at each position p of `ids`, predicting ids[p + 1]."""
        if self.model is None:
            return [[[-1.0 - r, r, None] for r in range(k)] for _ in ids]
        import torch

        with torch.no_grad():
            lp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)  # (L, V)
        vals, idx = lp.topk(k, -1)  # most likely first: python/sglang/srt/layers/logits_processor.py get_top_logprobs (all_logprobs.topk)
        return [[[v, i, None] for v, i in zip(vs, ix)] for vs, ix in zip(vals.tolist(), idx.tolist())]

    def one_generate(self, ids: list[int], sp: dict, return_logprob: bool, start: int, top: int = 0) -> dict:
        max_new = sp.get("max_new_tokens", 128)  # SamplingParams default (sampling/sampling_params.py)
        gen = self.gen_ids[:max_new]
        meta = {"id": "stub", "prompt_tokens": len(ids), "completion_tokens": len(gen), "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": max_new} if max_new == 0 else {"type": "stop"}}
        if return_logprob:
            meta["output_token_logprobs"] = [[-0.5 / 2**k, t, None] for k, t in enumerate(gen)]
            # Positions start .. len(ids)-1, values [None] + lp[:-1]: the entry at `start` is always
            # None (`_process_input_token_logprobs`, python/sglang/srt/managers/
            # scheduler_output_processor_mixin.py; scheduler_components/logprob_result_processor.py in
            # 0.5.23). Its ids are clipped: `x if x < vocab_size - 1 else 0` (same function).
            vals = [None] + [-0.1 * p for p in range(start + 1, len(ids))] if start < len(ids) else []
            idx = [t if t < self.vocab_size - 1 else 0 for t in ids[start:]]
            meta["input_token_logprobs"] = [[v, t, None] for v, t in zip(vals, idx)]
            if top > 0:
                # `_process_input_top_logprobs` (same file): [None], then the positions start .. len(ids)-2,
                # each the top k predicting the next input token (the last position's, which predicts
                # the first output token, popped); tokenizer_manager.py detokenize_top_logprobs_tokens
                # makes each position a list of (logprob, token_id, text|None), None left as None.
                at = self.top_at(ids, top)
                meta["input_top_logprobs"] = [None] + at[start: len(ids) - 1] if start < len(ids) else []
        return {"text": "", "output_ids": gen, "meta_info": meta}

    def generate(self, body: dict) -> tuple[int, object]:
        inputs = body.get("input_ids")
        if not inputs:
            # GenerateReqInput._validate_inputs (python/sglang/srt/managers/io_struct.py)
            return 400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
        single = isinstance(inputs[0], int)
        inputs = [inputs] if single else inputs
        per = lambda v, k: v[k] if isinstance(v, list) else v  # noqa: E731 (batch fields are lists or scalars)
        out = []
        for k, ids in enumerate(inputs):
            sp = per(body.get("sampling_params") or {}, k)
            unknown = sorted(set(sp) - SAMPLING_KEYS)
            if unknown:
                return 400, {"error": f"unknown field `{unknown[0]}`"}  # api_contract.py (0.5.23)
            return_logprob = bool(per(body.get("return_logprob", False), k))
            start = per(body.get("logprob_start_len", -1), k)
            if start is None or start == -1 or not return_logprob:
                # python/sglang/srt/managers/scheduler.py handle_generate_request: by default only
                # output log-probs; prefill-only requests skip input log-probs entirely.
                start = len(ids) if sp.get("max_new_tokens", 128) == 0 else len(ids) - 1
            if start >= len(ids) and sp.get("max_new_tokens", 128) != 0:
                # scheduler.py handle_generate_request (0.5.3-0.5.6): `not req.is_prefill_only and
                # req.logprob_start_len >= len(req.origin_input_ids)` aborts the request (0.5.23: `>`);
                # `_wait_one_response` in tokenizer_manager.py raises on a 400 abort, which fails the
                # batch's asyncio.gather, so the whole batch answers 400 (http_server.py generate_request).
                return 400, {"error": {"message": f"req.logprob_start_len={start} is higher than the number of "
                                                  f"input tokens len(req.origin_input_ids)={len(ids)}. "
                                                  "Please use a smaller logprob_start_len."}}
            top = int(per(body.get("top_logprobs_num", 0), k) or 0)  # GenerateReqInput: int or one per input
            out.append(self.one_generate(ids, sp, return_logprob, start, top))
        return 200, out[0] if single else out

    def update_weights(self, body: dict) -> tuple[int, dict]:
        if "model_path" not in body:  # UpdateWeightFromDiskReqInput.model_path has no default (io_struct.py)
            return 400, {"detail": "model_path: field required"}
        content = {"success": self.update_ok, "message": "Succeeded to update model weights." if self.update_ok
                   else "Failed to get weights iterator: shapes do not match", "num_paused_requests": 0}
        # http_server.py update_weights_from_disk: 200 on success, HTTPStatus.BAD_REQUEST otherwise.
        return (200 if self.update_ok else 400), content


def serve(stub: Stub, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, obj=None, raw: bytes | None = None):
            data = raw if raw is not None else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            # --api-key: "Authorization: Bearer <key>" or 401 (python/sglang/srt/utils/common.py
            # add_api_key_middleware in 0.5.3; python/sglang/srt/utils/auth.py in 0.5.23).
            if stub.api_key and self.headers.get("Authorization") != f"Bearer {stub.api_key}":
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            stub.headers.append(dict(self.headers))
            if not self._authorized():
                return
            if self.path == "/health":
                # http_server.py health_generate: 503 while ServerStatus.Starting, then 200.
                starting = time.monotonic() - stub.started < stub.starting_s
                self._send(503 if starting else 200, raw=b"")
            elif self.path == "/stub_env":  # test-only: what `launch_server` put in the environment
                self._send(200, {k: os.environ.get(k) for k in ORIGINAL_LOGPROB_ENV})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            stub.headers.append(dict(self.headers))
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            stub.requests.append((self.path, body))
            if not self._authorized():
                return
            fault = stub.faults.pop(0) if stub.faults else None
            if fault == "hang":
                stub.stop.wait(10)
                return
            if fault == "drop":  # close without an answer
                self.close_connection = True
                return
            if fault == "503":
                self._send(503, {"error": {"message": "The request queue is full."}})
                return
            if fault == "malformed":
                self._send(200, raw=b'{"text": "7", "meta_info": {')
                return
            if self.path == "/generate":
                code, obj = stub.generate(body)
            elif self.path == "/update_weights_from_disk":
                code, obj = stub.update_weights(body)
            else:
                code, obj = 404, {"detail": "Not Found"}
            results = obj if isinstance(obj, list) else [obj]
            if fault == "bad_ids":
                for r in results:
                    for e in r["meta_info"].get("output_token_logprobs", []):
                        e[1] = stub.vocab_size + 7
            elif fault == "long":
                for r in results:
                    r["meta_info"]["output_token_logprobs"] *= 50
            elif fault == "short_top":
                for r in results:
                    for pos in r["meta_info"].get("input_top_logprobs", [])[1:]:
                        pos.pop()
            elif fault == "none_inside":
                for r in results:
                    for e in r["meta_info"].get("input_token_logprobs", [])[1:]:
                        e[0] = None
            if fault == "trickle":
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    for b in data:
                        if stub.stop.wait(0.05):
                            return
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                except OSError:  # the client gave up
                    pass
                return
            self._send(code, obj)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def main(argv: list[str]) -> None:
    """Stands in for `python -m sglang.launch_server`: serves until killed."""
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key", default=None)
    a, _ = p.parse_known_args(argv)
    starting_s = float(os.environ.get("STUB_STARTING_S", "0"))
    server = serve(Stub([5, 1], vocab_size=64, starting_s=starting_s, api_key=a.api_key), a.host, a.port)
    try:
        threading.Event().wait()
    finally:
        server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
