"""Every request body opd sends to SGLang, validated against SGLang's own request classes.

With `sglang` installed (`pip install --no-deps sglang` works on a CPU machine; importing its server
does not), the field lists are read from its source with `ast`, without importing it, and 0.5.23's
JSON contract decoder (`sglang.api.v1.api_types`, needs only msgspec) is run on each /generate body.
Without it, the lists below are copies, so the check always runs.

Copied from the PyPI wheels sglang 0.5.3 and 0.5.23 (the ends of the range pinned in pyproject's
`sglang` extra; 0.5.6 was read too), files python/sglang/srt/managers/io_struct.py
(`GenerateReqInput`, `UpdateWeightFromDiskReqInput`) and python/sglang/srt/sampling/sampling_params.py
(`SamplingParams`: the __init__ arguments in 0.5.3, the "API parameters" fields in 0.5.23).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import math
from pathlib import Path

import pytest
from sglang_stub import Stub, serve

from opd.rollout import SamplingParams, get_engine

FIELDS = {
    "0.5.3": {
        "GenerateReqInput": [
            "rid", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params",
            "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
            "stream", "log_metrics", "return_hidden_states", "modalities", "session_params", "lora_path", "lora_id",
            "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
            "data_parallel_rank", "background", "conversation_id", "priority", "extra_key", "no_logs",
            "custom_labels", "return_bytes",
        ],
        "SamplingParams": [
            "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
            "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex", "ebnf",
            "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
            "custom_params", "stream_interval", "logit_bias", "sampling_seed",
        ],
        "UpdateWeightFromDiskReqInput": [
            "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
            "keep_pause",
        ],
    },
    "0.5.23": {
        "GenerateReqInput": [
            "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
            "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark",
            "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask",
            "sampling_logprobs_mode", "return_text_in_logprobs", "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream", "log_metrics",
            "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk",
            "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor",
            "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
            "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key",
            "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
            "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
            "return_prompt_token_ids", "external_trace_header", "received_time", "need_wait_for_mm_inputs",
            "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
            "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
            "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
        ],
        "SamplingParams": [
            "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
            "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
            "custom_params", "watermark",
        ],
        "UpdateWeightFromDiskReqInput": [
            "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
            "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest",
        ],
    },
}


@pytest.fixture
def sent(tokenizer, pico_model, tmp_path) -> dict[str, list[dict]]:
    """The bodies of every kind of request opd makes: generate (sampled and greedy, with top-k),
    score (with an empty completion among others), top-k scoring and a weight update."""
    stub = Stub(tokenizer("7\n", add_special_tokens=False).input_ids, pico_model.config.vocab_size)
    server = serve(stub)
    try:
        eng = get_engine("sglang", base_url=f"http://127.0.0.1:{server.server_address[1]}", tokenizer=tokenizer,
                         model=pico_model, timeout_s=5)
        eng.generate(["1+6=", "3+4="], n=2, params=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5))
        eng.generate(["1+6="], n=1, params=SamplingParams(temperature=0.0, top_k=5, max_new_tokens=3))
        eng.score([[5, 6, 7], [8], [9]], [[9, 10], [11, 12, 13], []])
        eng.top_logprobs([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], 4)
        eng.sync_weights(tmp_path)
    finally:
        stub.stop.set()
        server.shutdown()
        server.server_close()
    out: dict[str, list[dict]] = {}
    for path, body in stub.requests:
        out.setdefault(path, []).append(body)
    assert sorted(out) == ["/generate", "/update_weights_from_disk"] and len(out["/generate"]) == 4
    return out


def check_bodies(sent: dict[str, list[dict]], fields: dict[str, list[str]], version: str) -> None:
    for body in sent["/generate"]:
        assert set(body) <= set(fields["GenerateReqInput"]), (version, set(body) - set(fields["GenerateReqInput"]))
        sp = body["sampling_params"]
        assert set(sp) <= set(fields["SamplingParams"]), (version, set(sp) - set(fields["SamplingParams"]))
        # SamplingParams.verify (sampling_params.py): the values a server accepts.
        assert math.isfinite(sp["temperature"]) and sp["temperature"] >= 0
        assert 0 < sp.get("top_p", 1.0) <= 1 and (sp.get("top_k", -1) == -1 or sp["top_k"] >= 1)
        assert sp["max_new_tokens"] >= 0
        assert all(isinstance(t, int) for t in sp.get("stop_token_ids", []))
        ids = body["input_ids"]
        assert ids and all(isinstance(row, list) and row and all(isinstance(t, int) for t in row) for row in ids)
        if "top_logprobs_num" in body:  # GenerateReqInput: an int, or one per input (io_struct.py)
            assert isinstance(body["top_logprobs_num"], int) and body["top_logprobs_num"] >= 1
        if "logprob_start_len" in body:
            # scheduler.py handle_generate_request: a start at or past the input's end is refused.
            starts = body["logprob_start_len"]
            assert len(starts) == len(ids) and all(0 <= s < len(row) for s, row in zip(starts, ids))
    for body in sent["/update_weights_from_disk"]:
        assert "model_path" in body and set(body) <= set(fields["UpdateWeightFromDiskReqInput"])


@pytest.mark.parametrize("version", sorted(FIELDS))
def test_requests_match_copied_field_lists(sent, version):
    check_bodies(sent, FIELDS[version], version)


def _fields_in_source(path: Path, cls: str) -> list[str]:
    """A class's field names read from its source: annotated class attributes (dataclasses, msgspec
    structs) and __init__ arguments (SamplingParams before 0.5.6 was a plain class)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            for s in node.body:
                if isinstance(s, ast.FunctionDef) and s.name == "__init__":
                    names += [a.arg for a in s.args.args[1:] + s.args.kwonlyargs]
            return names + ["rid"]  # BaseReq's, inherited by GenerateReqInput from 0.5.3 on
    raise AssertionError(f"{cls} not found in {path}")


def _installed_sglang():
    try:
        return importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed (GPU machines only; `pip install --no-deps sglang` makes this run "
                    "on a CPU machine); the copied field lists are checked instead")


def test_requests_match_installed_sglang(sent):
    dist = _installed_sglang()
    io_struct = Path(dist.locate_file("sglang/srt/managers/io_struct.py"))
    sampling = Path(dist.locate_file("sglang/srt/sampling/sampling_params.py"))
    fields = {
        "GenerateReqInput": _fields_in_source(io_struct, "GenerateReqInput"),
        "UpdateWeightFromDiskReqInput": _fields_in_source(io_struct, "UpdateWeightFromDiskReqInput"),
        "SamplingParams": _fields_in_source(sampling, "SamplingParams"),
    }
    check_bodies(sent, fields, dist.version)


def test_generate_bodies_pass_sglang_json_contract(sent):
    # From 0.5.23 /generate runs `GenerateRequest.from_json_value(body)` before anything else
    # (python/sglang/srt/entrypoints/api_contract.py); unknown sampling_params keys are refused.
    dist = _installed_sglang()
    path = Path(dist.locate_file("sglang/api/v1/api_types.py"))
    if not path.exists():
        pytest.skip(f"sglang {dist.version} has no JSON contract module (added after 0.5.6)")
    if importlib.util.find_spec("msgspec") is None:
        pytest.skip("msgspec (needed by sglang.api.v1.api_types) is not installed")
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    api_types = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_types)
    for body in sent["/generate"]:
        api_types.GenerateRequest.from_json_value(body)  # raises JsonContractError on a violation
    with pytest.raises(api_types.JsonContractError, match="unknown field"):
        api_types.GenerateRequest.from_json_value({**body, "sampling_params": {"seed": 1}})
