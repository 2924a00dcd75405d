"""Rollouts from an SGLang server over HTTP. This module never imports `sglang`: the server runs in
its own process (on a GPU machine, with its own torch), started by `launch_server` or by hand with
`SGLANG_RETURN_ORIGINAL_LOGPROB=1 RETURN_ORIGINAL_LOGPROB=1 python -m sglang.launch_server ...`.

Native API fields used (SGLang `GenerateReqInput` / `SamplingParams` / `UpdateWeightFromDiskReqInput`
in python/sglang/srt/managers/io_struct.py and sampling/sampling_params.py; checked against 0.5.3,
0.5.6 and 0.5.23, tests/test_sglang_contract.py):
- POST /generate {"input_ids": [[...], ...], "sampling_params": {temperature, top_p, top_k,
  max_new_tokens, stop_token_ids, no_stop_trim, skip_special_tokens}, "return_logprob": true,
  "logprob_start_len": [k, ...]} -> one object per input, in input order, with
  meta_info.output_token_logprobs and meta_info.input_token_logprobs, each a list of
  [logprob, token_id, text|null].
- The same with "top_logprobs_num": k (teacher top-k scoring, `top_logprobs`) -> also
  meta_info.input_top_logprobs, one list of k [logprob, token_id, text] per position (None at the first).
- POST /update_weights_from_disk {"model_path": dir} -> {"success", "message", ...}; HTTP 400 on failure.
- GET /health -> 503 while the server starts, then 200.

Input log-probs (teacher scoring): input_token_logprobs covers positions k .. len(ids)-1 and its
values are `[None] + lp[:-1]` (`_process_input_token_logprobs` in the scheduler's output
processor): entry 0 is always None and entry j > 0 is log p(ids[k+j] | ids[:k+j]). So a completion
c after a prompt p is scored with k = len(p) - 1, keeping the last len(c) entries. k < len(ids)
always holds then, which older servers require of every input (else HTTP 400 for the whole batch).

Output log-probs: SGLang reports the log-prob of the distribution it sampled from (after temperature
and top-p) unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (read by 0.5.6 and later;
0.5.3 reads RETURN_ORIGINAL_LOGPROB=1); `launch_server` sets both, so that, as with the embedded engine,
log-probs are the model's temperature-1 log-softmax. Input log-probs are always at temperature 1.
SamplingParams.seed is not sent: SGLang's batched sampling is not reproducible per request, so seeded
determinism is an embedded-engine property.

Robustness: every call has one overall deadline (`timeout_s`, retries included, enforced by closing
the socket, so a server that trickles bytes cannot stretch it), a bounded response size, retries with
exponential backoff on connection errors and HTTP 503, and validated answers (token ids inside the
vocabulary, at most max_new_tokens per sample, finite log-probs). Every failure is one-line OpdError.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from dataclasses import dataclass
from pathlib import Path

from opd.errors import OpdError
from opd.rollout.base import Rollout, SamplingParams, cut_at_stop, stop_token_ids

# Both names: 0.5.6 and later read SGLANG_RETURN_ORIGINAL_LOGPROB, 0.5.3 RETURN_ORIGINAL_LOGPROB
# (python/sglang/srt/layers/sampler.py).
ORIGINAL_LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "RETURN_ORIGINAL_LOGPROB": "1"}
API_KEY_ENV = "OPD_SGLANG_API_KEY"
_LOGPROB_SLACK = 1e-3  # a log-prob above this is not a log-prob (rounding may give +1e-7)


class _Retryable(Exception):
    """A failure worth another try: no answer at all, or HTTP 503 (the server is starting)."""


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


@dataclass(frozen=True)
class HttpClient:
    """JSON over HTTP with one deadline per call. retries: extra tries after a connection error or
    a 503, `backoff_s` doubling each time; all of them inside `timeout_s`."""

    base_url: str
    timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5
    max_response_bytes: int = 256 << 20
    api_key: str | None = None

    def request(self, method: str, path: str, payload: dict | None = None, timeout_s: float | None = None):
        """The decoded JSON answer; OpdError for anything else."""
        url = f"{self.base_url}{path}"
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        body = None if payload is None else json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            try:
                status, data = self._once(method, url, body, deadline, budget)
            except _Retryable as e:
                last = str(e)
            else:
                if status == 503:
                    last = f"HTTP 503: {_one_line(data.decode(errors='replace'))}"
                else:
                    return self._decode(url, status, data)
            wait = self.backoff_s * 2**attempt
            if attempt == self.retries or time.monotonic() + wait >= deadline:
                break
            time.sleep(wait)
        raise OpdError(f"sglang server {url}: no answer after {attempt + 1} tries ({last}); is it running? "
                       "start it with opd.rollout.sglang.launch_server or python -m sglang.launch_server")

    def _once(self, method: str, url: str, body: bytes | None, deadline: float, budget: float) -> tuple[int, bytes]:
        late = OpdError(f"sglang server {url}: no complete answer within {budget:g} s "
                        "(hung or too slow; raise timeout_s for long generations)")
        u = urllib.parse.urlsplit(url)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise late
        conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(u.hostname, u.port, timeout=remaining)
        expired, sock = threading.Event(), []

        def expire():  # the overall deadline: unblock whatever read is in progress
            expired.set()
            for s in sock:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(remaining, expire)
        timer.daemon = True
        timer.start()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.connect()
            sock.append(conn.sock)  # the response takes the socket over from `conn`: keep a handle
            if expired.is_set():
                raise TimeoutError
            conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_response_bytes:
                raise OpdError(f"sglang server {url}: answer of {int(length)} bytes exceeds "
                               f"max_response_bytes={self.max_response_bytes}")
            chunks, size = [], 0
            while chunk := resp.read1(1 << 16):
                size += len(chunk)
                if size > self.max_response_bytes:
                    raise OpdError(f"sglang server {url}: answer exceeds max_response_bytes={self.max_response_bytes}")
                chunks.append(chunk)
            if expired.is_set():
                raise TimeoutError
            if resp.length:  # fewer bytes than Content-Length: the server closed mid-answer
                raise OpdError(f"sglang server {url}: answer cut short ({size} bytes, {resp.length} missing)")
            return resp.status, b"".join(chunks)
        except OpdError:
            raise
        except TimeoutError:
            raise late from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            if expired.is_set():
                raise late from None
            if isinstance(e, http.client.IncompleteRead):
                raise OpdError(f"sglang server {url}: answer cut short ({_one_line(e)})") from None
            raise _Retryable(f"{type(e).__name__}: {_one_line(e) or 'connection failed'}") from None
        finally:
            timer.cancel()
            conn.close()

    @staticmethod
    def _decode(url: str, status: int, data: bytes):
        text = data.decode(errors="replace")
        if status == 401:
            raise OpdError(f"sglang server {url}: HTTP 401 unauthorized; the server runs with --api-key: "
                           f"pass api_key (or set {API_KEY_ENV})")
        if status != 200:
            raise OpdError(f"sglang server {url}: HTTP {status}: {_one_line(text)}")
        if not text.strip():  # /health answers 200 with no body
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise OpdError(f"sglang server {url}: answer is not JSON: {_one_line(text, 120)!r}") from None


def _entries(res, key: str, url: str) -> list:
    meta = res.get("meta_info") if isinstance(res, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get(key), list):
        raise OpdError(f"sglang server {url}: an answer lacks meta_info.{key} (was return_logprob sent?)")
    for e in meta[key]:
        if not isinstance(e, list | tuple) or len(e) < 2 or not isinstance(e[1], int):
            raise OpdError(f"sglang server {url}: meta_info.{key} entry {_one_line(repr(e), 80)} is not "
                           "[logprob, token_id, text]")
    return meta[key]


def _logprob(value, url: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value > _LOGPROB_SLACK:
        raise OpdError(f"sglang server {url}: {what} has log-prob {value!r}, not a finite number <= 0")
    return float(value)


class SGLangEngine:
    """Client for one SGLang server.

    base_url: e.g. "http://127.0.0.1:30000". tokenizer: the served model's tokenizer (prompts are
    encoded here, without special tokens, so ids match the embedded engine). stop_ids: ids that end
    an answer; default: `model`'s generation_config.eos_token_id, else the tokenizer's eos.
    weights_dir: where `sync_weights(model)` saves the policy before asking the server to load it.
    timeout_s: the most one call may take, retries included. vocab_size: token ids the server may
    return (default: `model.config.vocab_size`, else `len(tokenizer)`). api_key: for a server started
    with --api-key (default: $OPD_SGLANG_API_KEY).
    """

    def __init__(self, base_url: str, tokenizer, stop_ids: list[int] | None = None, model=None,
                 weights_dir: str | os.PathLike | None = None, timeout_s: float = 600.0, retries: int = 3,
                 backoff_s: float = 0.5, max_response_bytes: int = 256 << 20, api_key: str | None = None,
                 vocab_size: int | None = None):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(model, tokenizer)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.timeout_s = timeout_s
        config_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        self.vocab_size = int(vocab_size or config_vocab or len(tokenizer))
        self.http = HttpClient(self.base_url, timeout_s, retries, backoff_s, max_response_bytes,
                               api_key or os.environ.get(API_KEY_ENV) or None)

    def _generate_request(self, payload: dict) -> list[dict]:
        out = self.http.request("POST", "/generate", payload, self.timeout_s)
        out = out if isinstance(out, list) else [out]
        if len(out) != len(payload["input_ids"]):
            raise OpdError(f"sglang server {self.base_url}/generate: sent {len(payload['input_ids'])} inputs, "
                           f"got {len(out)} results")
        return out

    def _check_id(self, token_id: int, what: str) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise OpdError(f"{what} has token id {token_id}, outside the vocabulary [0, {self.vocab_size}) of "
                           f"{self.base_url}; do client and server use the same model and tokenizer?")
        return token_id

    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[list[Rollout]]:
        """`n` samples per prompt, sent as one batch of prompt-major repeated inputs."""
        encoded = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(n)]
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 means no top-k cut
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": self.stop_ids,
            "no_stop_trim": True,  # keep the stop token, as the embedded engine does
            "skip_special_tokens": False,
        }
        results = self._generate_request(
            {"input_ids": [ids for _, ids in flat], "sampling_params": sampling, "return_logprob": True}
        )
        out: list[list[Rollout]] = [[] for _ in prompts]
        stops = set(self.stop_ids)
        for k, ((i, p_ids), res) in enumerate(zip(flat, results, strict=True)):
            entries = _entries(res, "output_token_logprobs", self.base_url)
            if len(entries) > params.max_new_tokens:
                raise OpdError(f"sglang server {self.base_url}: sample {k} has {len(entries)} tokens, more than "
                               f"max_new_tokens={params.max_new_tokens}")
            ids = cut_at_stop([self._check_id(e[1], f"sglang server {self.base_url}: sample {k}") for e in entries], stops)
            lps = [_logprob(e[0], self.base_url, f"sample {k}") for e in entries[: len(ids)]]
            out[i].append(Rollout(prompts[i], list(p_ids), ids, self.tokenizer.decode(ids, skip_special_tokens=True), lps))
        return out

    def _prefill(self, what: str, prompt_ids: list[list[int]], completion_ids: list[list[int]], **extra
                 ) -> tuple[list[int], list[dict]]:
        """One prefill-only request (max_new_tokens 0, temperature 1) for the non-empty completions, input
        log-probs from position len(prompt) - 1 on (`extra`: more GenerateReqInput fields). Returns the rows
        asked (indices into the completions) and their answers; none asked, no request."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{what}: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError(f"{what}: every prompt needs at least one token to condition on")
        rows = [k for k, c in enumerate(completion_ids) if len(c) > 0]
        if not rows:
            return [], []
        for k in rows:
            for t in list(prompt_ids[k]) + list(completion_ids[k]):
                self._check_id(int(t), f"{what}: input {k}")
        payload = {
            "input_ids": [list(prompt_ids[k]) + list(completion_ids[k]) for k in rows],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": [len(prompt_ids[k]) - 1 for k in rows],
            **extra,
        }
        return rows, self._generate_request(payload)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced temperature-1 log-probs of each completion: one prefill-only request
        (max_new_tokens 0) for the non-empty completions, logprob_start_len = prompt length - 1.
        An empty completion scores [] without asking the server."""
        out: list[list[float]] = [[] for _ in completion_ids]
        rows, results = self._prefill("score", prompt_ids, completion_ids)
        for k, res in zip(rows, results, strict=True):
            c = list(completion_ids[k])
            entries = _entries(res, "input_token_logprobs", self.base_url)
            # From position len(p) - 1: one None (it scores nothing), then one entry per completion token.
            tail = entries[len(entries) - len(c):]
            if len(entries) != len(c) + 1 or not all(_same_id(e[1], t, self.vocab_size) for e, t in zip(tail, c)):
                raise OpdError(f"sglang server {self.base_url}: input_token_logprobs do not line up with "
                               f"completion {k} ({len(entries)} entries for {len(c)} tokens after the prompt's last)")
            if any(e[0] is None for e in tail):
                raise OpdError(f"sglang server {self.base_url}: input_token_logprobs of completion {k} hold None "
                               "inside the completion (a server that does not pad position logprob_start_len?)")
            out[k] = [_logprob(e[0], self.base_url, f"completion {k}") for e in tail]
        return out

    def top_logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], k: int
                     ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """The server's k most likely tokens and their temperature-1 log-probs at each completion token's
        position, teacher-forced: per completion, (ids, logprobs), one list of k per token (in the server's
        order, most likely first). One prefill-only request, as `score`, with top_logprobs_num k.

        meta_info.input_top_logprobs lines up with input_token_logprobs: entry 0 (position
        logprob_start_len) is None and entry j > 0 holds the top k at the position that predicts
        ids[start + j], each [logprob, token_id, text] (`_process_input_top_logprobs` in
        python/sglang/srt/managers/scheduler_output_processor_mixin.py: `[None]` then the positions,
        the last popped; `detokenize_top_logprobs_tokens` in python/sglang/srt/managers/tokenizer_manager.py
        turns each position into (logprob, token_id, text|None) tuples and leaves None as None)."""
        k = min(int(k), self.vocab_size)
        out: list[tuple[list[list[int]], list[list[float]]]] = [([], []) for _ in completion_ids]
        rows, results = self._prefill("top_logprobs", prompt_ids, completion_ids, top_logprobs_num=k)
        where = f"sglang server {self.base_url}"
        for j, res in zip(rows, results, strict=True):
            n = len(completion_ids[j])
            meta = res.get("meta_info") if isinstance(res, dict) else None
            tops = meta.get("input_top_logprobs") if isinstance(meta, dict) else None
            if not isinstance(tops, list) or len(tops) != n + 1:
                got = f"{len(tops)} entries" if isinstance(tops, list) else "none"
                raise OpdError(f"{where}: meta_info.input_top_logprobs of completion {j} has {got} for its {n} "
                               "tokens after the prompt's last (was top_logprobs_num sent?)")
            ids, lps = [], []
            for t, pos in enumerate(tops[1:]):
                if not isinstance(pos, list) or len(pos) != k or not all(
                        isinstance(e, list | tuple) and len(e) >= 2 and isinstance(e[1], int) for e in pos):
                    raise OpdError(f"{where}: meta_info.input_top_logprobs of completion {j}, token {t}, is not "
                                   f"{k} [logprob, token_id, text] entries")
                ids.append([self._check_id(e[1], f"{where}: completion {j}'s top log-probs") for e in pos])
                lps.append([_logprob(e[0], self.base_url, f"completion {j}'s top log-probs") for e in pos])
                if len(set(ids[-1])) != k:
                    raise OpdError(f"{where}: meta_info.input_top_logprobs of completion {j}, token {t}, repeats a "
                                   "token id")
            out[j] = (ids, lps)
        return out

    def sync_weights(self, model) -> None:
        """Load new weights into the server: `model` is a saved HF model directory, or a model that is
        first saved to `weights_dir` (a temp dir by default) with save_pretrained."""
        if isinstance(model, str | os.PathLike):
            path = Path(model)
        else:
            if self.weights_dir is None:
                self.weights_dir = Path(tempfile.mkdtemp(prefix="opd-sglang-weights-"))
                # a full model copy: removed with this client (or at exit), not left behind in /tmp
                weakref.finalize(self, shutil.rmtree, self.weights_dir, True)
            model.save_pretrained(self.weights_dir)
            path = self.weights_dir
        try:
            res = self.http.request("POST", "/update_weights_from_disk", {"model_path": str(path)})
        except OpdError as e:
            raise OpdError(f"weight update from {path} failed: {e}") from None
        if not isinstance(res, dict) or not res.get("success", False):
            msg = res.get("message", res) if isinstance(res, dict) else res
            raise OpdError(f"sglang server {self.base_url}/update_weights_from_disk: weight update from {path} "
                           f"failed: {_one_line(msg)}")


def _same_id(reported: int, sent: int, vocab_size: int) -> bool:
    # The server reports input ids >= vocab_size - 1 as 0 ("clip padded hash values from image
    # tokens", `_process_input_token_logprobs` in the scheduler's output processor).
    return reported == sent or (reported == 0 and sent >= vocab_size - 1)


def health(base_url: str, timeout_s: float = 5.0, api_key: str | None = None) -> bool:
    """True when GET {base_url}/health answers 200 (SGLang answers 503 while it starts)."""
    client = HttpClient(base_url.rstrip("/"), timeout_s, retries=0, api_key=api_key or os.environ.get(API_KEY_ENV))
    try:
        client.request("GET", "/health")
        return True
    except OpdError:
        return False


@dataclass
class ServerHandle:
    """A launched server: its process and URL. `close()` stops it and removes its temp log (also usable
    as a context manager); the log also goes at exit if nobody closed the handle."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    def __post_init__(self):
        self._remove_log = weakref.finalize(self, Path.unlink, self.log_path, True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return _one_line(self.log_path.read_text(errors="replace")[-n:], n)
        except OSError:
            return ""

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._remove_log()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def launch_server(model_path: str | os.PathLike, port: int, extra_args: list[str] | None = None,
                  host: str = "127.0.0.1", timeout_s: float = 600.0, python: str = sys.executable,
                  api_key: str | None = None) -> ServerHandle:
    """Start `python -m sglang.launch_server` as a subprocess and wait until /health answers 200.

    The server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 and RETURN_ORIGINAL_LOGPROB=1 (temperature-1
    output log-probs on new and old servers). api_key: passed as --api-key and used for the health check.
    Its output goes to a temp log file (removed by `close()`) whose tail is quoted when the server dies
    or does not come up.
    """
    if python == sys.executable and importlib.util.find_spec("sglang") is None:
        raise OpdError("sglang is not installed in this environment; on a GPU machine: pip install 'opd[sglang]' "
                       "(it needs CUDA; see NOTES.md), or pass python= pointing at an interpreter that has it")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port), *(["--api-key", api_key] if api_key else []), *(extra_args or [])]
    log_path = Path(tempfile.mkstemp(prefix="opd-sglang-", suffix=".log")[1])
    env = {**os.environ, **ORIGINAL_LOGPROB_ENV}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(proc, f"http://{host}:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = handle.log_tail()
            handle.close()
            raise OpdError(f"sglang server exited with code {proc.returncode}: {tail}")
        if health(handle.base_url, timeout_s=5.0, api_key=api_key):
            return handle
        time.sleep(0.5)
    tail = handle.log_tail()
    handle.close()
    raise OpdError(f"sglang server did not answer {handle.base_url}/health within {timeout_s:.0f} s: {tail}")
