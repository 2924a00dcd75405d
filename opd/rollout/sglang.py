"""Rollouts from an SGLang server over HTTP. This module never imports `sglang`: the server runs in
its own process (on a GPU machine, with its own torch), started by `launch_server` or by hand with
`python -m sglang.launch_server --model-path DIR --port PORT`.

Native API fields used (SGLang `GenerateReqInput` / `SamplingParams`):
- POST /generate {"input_ids": [[...], ...], "sampling_params": {temperature, top_p, top_k,
  max_new_tokens, stop_token_ids, no_stop_trim}, "return_logprob": true, "logprob_start_len": k}
  -> one object per input with meta_info.output_token_logprobs and meta_info.input_token_logprobs,
  each a list of [logprob, token_id, text|null]; input_token_logprobs starts at prompt position k.
- POST /update_weights_from_disk {"model_path": dir} -> {"success": bool, "message": str}
- GET /health -> 200 once the server is up.

Output logprobs: SGLang reports the log-prob of the distribution it sampled from (after temperature
and top-p) unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which `launch_server` sets
so that, as with the embedded engine, logprobs are the model's temperature-1 log-softmax. Input
(scoring) logprobs are always at temperature 1. SamplingParams.seed is not sent: SGLang's batched
sampling is not reproducible per request, so seeded determinism is an embedded-engine property.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from opd.errors import OpdError
from opd.rollout.base import Rollout, SamplingParams, cut_at_stop, stop_token_ids


def _post(url: str, payload: dict, timeout_s: float):
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:300]
        raise OpdError(f"sglang server {url}: HTTP {e.code}: {body}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise OpdError(f"sglang server {url} unreachable ({reason}); is it running? "
                       "start it with opd.rollout.sglang.launch_server or python -m sglang.launch_server") from None


def _entries(meta: dict, key: str, url: str) -> list[list]:
    if key not in meta:
        raise OpdError(f"sglang server {url}: response meta_info lacks {key!r} (was return_logprob sent?)")
    return meta[key]


class SGLangEngine:
    """Client for one SGLang server.

    base_url: e.g. "http://127.0.0.1:30000". tokenizer: the served model's tokenizer (prompts are
    encoded here, without special tokens, so ids match the embedded engine). stop_ids: ids that end
    an answer; default: `model`'s generation_config.eos_token_id, else the tokenizer's eos.
    weights_dir: where `sync_weights(model)` saves the policy before asking the server to load it.
    """

    def __init__(self, base_url: str, tokenizer, stop_ids: list[int] | None = None, model=None,
                 weights_dir: str | os.PathLike | None = None, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(model, tokenizer)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.timeout_s = timeout_s

    def _generate_request(self, payload: dict) -> list[dict]:
        url = f"{self.base_url}/generate"
        out = _post(url, payload, self.timeout_s)
        out = out if isinstance(out, list) else [out]
        if len(out) != len(payload["input_ids"]):
            raise OpdError(f"sglang server {url}: sent {len(payload['input_ids'])} inputs, got {len(out)} results")
        return out

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
        for (i, p_ids), res in zip(flat, results, strict=True):
            entries = _entries(res.get("meta_info", {}), "output_token_logprobs", self.base_url)
            ids = cut_at_stop([int(e[1]) for e in entries], stops)
            lps = [float(e[0]) for e in entries[: len(ids)]]
            out[i].append(Rollout(prompts[i], list(p_ids), ids, self.tokenizer.decode(ids), lps))
        return out

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced temperature-1 log-probs of each completion, by a prefill-only request
        (max_new_tokens 0) per sequence with logprob_start_len = prompt length."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("score: every prompt needs at least one token to condition on")
        payload = {
            "input_ids": [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": [len(p) for p in prompt_ids],
        }
        out = []
        for c, res in zip(completion_ids, self._generate_request(payload), strict=True):
            entries = _entries(res.get("meta_info", {}), "input_token_logprobs", self.base_url)
            # Entries run from the prompt's end to the last input token; keep the completion's.
            tail = entries[len(entries) - len(c) :] if c else []
            if len(tail) != len(c) or [int(e[1]) for e in tail] != list(c):
                raise OpdError(f"sglang server {self.base_url}: input_token_logprobs do not line up with "
                               f"the completion ({len(entries)} entries for {len(c)} tokens)")
            out.append([float(e[0]) for e in tail])
        return out

    def sync_weights(self, model) -> None:
        """Load new weights into the server: `model` is a saved HF model directory, or a model that is
        first saved to `weights_dir` (a temp dir by default) with save_pretrained."""
        if isinstance(model, (str, os.PathLike)):
            path = Path(model)
        else:
            if self.weights_dir is None:
                self.weights_dir = Path(tempfile.mkdtemp(prefix="opd-sglang-weights-"))
            model.save_pretrained(self.weights_dir)
            path = self.weights_dir
        url = f"{self.base_url}/update_weights_from_disk"
        res = _post(url, {"model_path": str(path)}, self.timeout_s)
        if not res.get("success", False):
            raise OpdError(f"sglang server {url}: weight update from {path} failed: {res.get('message', res)}")


def health(base_url: str, timeout_s: float = 5.0) -> bool:
    """True when GET {base_url}/health answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclass
class ServerHandle:
    """A launched server: its process and URL. `close()` stops it (also usable as a context manager)."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def launch_server(model_path: str | os.PathLike, port: int, extra_args: list[str] | None = None,
                  host: str = "127.0.0.1", timeout_s: float = 600.0, python: str = sys.executable) -> ServerHandle:
    """Start `python -m sglang.launch_server` as a subprocess and wait until /health answers.

    Its output goes to a log file whose tail is quoted when the server dies or does not come up.
    """
    import importlib.util

    if python == sys.executable and importlib.util.find_spec("sglang") is None:
        raise OpdError("sglang is not installed in this environment; on a GPU machine: pip install 'opd[sglang]' "
                       "(it needs CUDA; see NOTES.md), or pass python= pointing at an interpreter that has it")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port), *(extra_args or [])]
    log_path = Path(tempfile.mkstemp(prefix="opd-sglang-", suffix=".log")[1])
    env = {**os.environ, "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(proc, f"http://{host}:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise OpdError(f"sglang server exited with code {proc.returncode} (log {log_path}): {tail}")
        if health(handle.base_url, timeout_s=2.0):
            return handle
        time.sleep(1.0)
    handle.close()
    raise OpdError(f"sglang server did not answer {handle.base_url}/health within {timeout_s:.0f} s (log {log_path})")
