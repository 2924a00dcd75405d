"""The BPE lab: a byte-level BPE tokenizer trained on the lab's stream, and what it exposes.

With one id per character, text and ids are interchangeable; with a BPE they are not (one text has
several tokenizations, an answer spans several tokens, "\\n" is spelled "Ċ"). These tests pin down
where each path turns text into ids, and run the whole lab path (base, two experts, a merge, OPD,
lm-eval through the CLI and the API) on a tiny BPE base.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from opd.capabilities import get_capability, list_capabilities
from opd.errors import OpdError
from opd.io import tokenizer_hash
from opd.lab.base import BaseSpec, build_tokenizer
from opd.lab.data import encode_sft
from opd.lab.model import build_model
from opd.lab.pico import PICO
from opd.lab.tokenizer import newline_id

BUILTIN = [c for c in list_capabilities() if not c.startswith("rg:")]


def bpe_spec(**kw) -> BaseSpec:
    fields = dict(capabilities=["count", "add"], mixture={"count": 1.0, "add": 1.0}, tokenizer="bpe",
                  bpe_vocab_size=320, shape=PICO, threads=1, report_to="none")
    return BaseSpec(**{**fields, **kw})


@pytest.fixture(scope="module")
def bpe():
    # the whole builtin mixture, so every capability's answers get merges
    return build_tokenizer(bpe_spec(capabilities=BUILTIN, mixture=dict.fromkeys(BUILTIN, 1.0)))


def test_bpe_is_deterministic_and_reloads_as_the_same_tokenizer(bpe, tmp_path):
    from transformers import AutoTokenizer

    assert len(bpe) == 320 and tokenizer_hash(bpe) == tokenizer_hash(
        build_tokenizer(bpe_spec(capabilities=BUILTIN, mixture=dict.fromkeys(BUILTIN, 1.0))))
    bpe.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)  # what experts, mergekit and lm-eval load
    assert tokenizer_hash(again) == tokenizer_hash(bpe) and again.encode("m:48,28,94=") == bpe.encode("m:48,28,94=")
    # another vocabulary size or the char tokenizer is another tokenizer
    assert tokenizer_hash(build_tokenizer(bpe_spec(bpe_vocab_size=300))) != tokenizer_hash(bpe)
    assert tokenizer_hash(build_tokenizer(bpe_spec(tokenizer="char"))) != tokenizer_hash(bpe)


def test_bpe_spec_is_validated_and_char_bases_keep_their_cache_key():
    with pytest.raises(ValueError, match="bpe_vocab_size"):
        bpe_spec(bpe_vocab_size=200)  # not even the 256 bytes
    with pytest.raises(ValueError, match="tokenizer"):
        bpe_spec(tokenizer="wordpiece")
    # a char base built before the field existed is still up to date
    char = bpe_spec(tokenizer="char")
    assert "bpe_vocab_size" not in char.training_fields()
    old = {k: v for k, v in char.training_fields().items() if k != "tokenizer"}
    from opd.lab.base import same_training

    assert same_training(old, char) and not same_training(old, bpe_spec())
    # the thread count changes how fast a base trains, not what it learns: a base built (or resumed)
    # on one thread is reused on two
    assert same_training(bpe_spec(threads=1).training_fields(), bpe_spec(threads=2))
    assert same_training({**old, "threads": 2}, char)  # manifests written before threads was excluded


def test_the_shipped_base_spec_selects_the_bpe():
    from opd.lab.base import load_base_spec

    assert load_base_spec().tokenizer == "char"
    spec = load_base_spec(tokenizer="bpe")  # python scripts/build_base.py tokenizer=bpe
    tok = build_tokenizer(spec)
    assert len(tok) == spec.bpe_vocab_size == 512
    # every capability of the mixture encodes without <unk>
    for cap in spec.mixture:
        for it in get_capability(cap).items("val", 20):
            assert tok.unk_token_id not in tok.encode(it.prompt + it.answer + "\n", add_special_tokens=False)


def test_qwen2_split_spells_numbers_digit_by_digit_and_gpt2_merges_them(bpe):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from opd.lab.tokenizer import QWEN2_SPLIT

    assert QWEN2_SPLIT == PRETOKENIZE_REGEX  # the copy is Qwen2/3's own split
    digits = [it.answer for cap in ("add", "max", "sort") for it in get_capability(cap).items("val", 30)]
    for text in digits:
        assert [bpe.decode([i]) for i in bpe.encode(text, add_special_tokens=False)] == list(text)
    # letter runs still merge: answers of the letter tasks span fewer tokens than characters
    words = [it.answer for it in get_capability("dedup").items("val", 30)]
    assert sum(len(bpe.encode(w, add_special_tokens=False)) for w in words) < sum(map(len, words))
    gpt2 = build_tokenizer(bpe_spec(capabilities=BUILTIN, mixture=dict.fromkeys(BUILTIN, 1.0), bpe_split="gpt2"))
    assert any(len(gpt2.encode(t, add_special_tokens=False)) < len(t) for t in digits)
    assert tokenizer_hash(gpt2) != tokenizer_hash(bpe)
    assert "bpe_split" not in bpe_spec(tokenizer="char").training_fields()
    with pytest.raises(ValueError, match="bpe_split"):
        bpe_spec(bpe_split="llama")


def test_newline_stop_is_one_token_the_model_stops_on(bpe):
    """The engines stop on the "\\n" id, lm-eval's `until` on the decoded text: they agree only if
    "\\n" is one token that no other token contains. The model's stop list used
    `convert_tokens_to_ids("\\n")`, which is <unk> in a byte-level vocabulary ("\\n" is "Ċ")."""
    nl = newline_id(bpe)
    assert bpe.convert_ids_to_tokens(nl) == "Ċ" and bpe.convert_tokens_to_ids("\n") == bpe.unk_token_id
    assert [t for t, i in bpe.get_vocab().items() if i != nl and "\n" in bpe.decode([i])] == []
    assert build_model(PICO, bpe, seed=0).generation_config.eos_token_id == [nl, bpe.eos_token_id]


@pytest.mark.parametrize("cap", BUILTIN)
def test_no_merge_spans_the_prompt_answer_boundary(bpe, cap):
    """SFT encodes prompt and answer separately and concatenates the ids, as generation continues from
    the prompt's ids: the whole text re-tokenized gives the same ids (no token joins "=" to an answer),
    and the labels are exactly the answer's tokens, several of them when the answer is long."""
    items = get_capability(cap).items("val", 40)
    batch = encode_sft(bpe, items)
    multi = 0
    for row, it in enumerate(items):
        p = bpe.encode(it.prompt, add_special_tokens=False)
        a = bpe.encode(it.answer + "\n", add_special_tokens=False)
        assert bpe.encode(it.prompt + it.answer + "\n", add_special_tokens=False) == p + a
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        assert ids[: len(p) + len(a)].tolist() == p + a
        assert bpe.decode(labels[labels != -100]) == it.answer + "\n"
        multi += len(a) > 2  # the answer itself spans several tokens, plus "\n"
    if cap in ("rev", "sort", "shift", "dedup", "rot", "max", "add", "sub", "mul"):
        assert multi > 0, f"{cap}: no answer spans several tokens; the test would not exercise them"


def test_completion_ids_are_trained_as_sampled_not_retokenized(bpe):
    """A BPE model may sample a non-canonical split of its answer ("f","c" for "fc"; digits are single tokens under the qwen2 split): the engine's
    log-probs, the teacher's scores and the OPD/GSPO batches use the ids as sampled, and the reward
    uses their text. Re-tokenizing the text would score other tokens than the ones sampled."""
    from opd.distill.batch import build_batch
    from opd.distill.routing import resolve_routes
    from opd.distill.teachers import embedded_teacher
    from opd.rl.batch import group_rollouts
    from opd.rollout import SamplingParams, get_engine

    torch.manual_seed(0)
    model = build_model(PICO, bpe, seed=0)
    engine = get_engine("embedded", model=model, tokenizer=bpe)
    items = get_capability("dedup").items("val", 8)
    groups = engine.generate([it.prompt for it in items], 8, SamplingParams(temperature=1.5, max_new_tokens=6, seed=0))
    rollouts = [r for g in groups for r in g]
    retok = [r for r in rollouts if bpe.encode(r.text, add_special_tokens=False) != r.completion_ids]
    assert retok, "no sample was tokenized non-canonically; the test would not exercise the hazard"
    scored = engine.score([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts])
    for r, lp in zip(rollouts, scored):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(r.logprobs), atol=1e-4, rtol=0)
    teacher = embedded_teacher("dedup", "dedup", build_model(PICO, bpe, seed=1), bpe)
    batch = build_batch(model, items, groups, {"dedup": teacher}, resolve_routes({"dedup": "dedup"}), bpe.pad_token_id)
    for b, r in enumerate(rollouts):
        n = len(r.completion_ids)
        assert batch.targets[b, :n].tolist() == r.completion_ids and int(batch.cmask[b].sum()) == n
    grouped = group_rollouts([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], bpe.pad_token_id)
    assert all(grouped.completion_ids[b, : len(r.completion_ids)].tolist() == r.completion_ids
               for b, r in enumerate(rollouts))
    # an answer that spans several tokens, sampled as single characters, is still right
    answer = next(it.answer for it in get_capability("dedup").items("val", 100)
                  if len(bpe.encode(it.answer, add_special_tokens=False)) < len(it.answer))  # e.g. "hfcfe" = "h","fc","fe"
    chars = [bpe.encode(ch, add_special_tokens=False)[0] for ch in answer] + [newline_id(bpe)]
    text = bpe.decode(chars, skip_special_tokens=True)
    assert get_capability("dedup").verify(text, answer) == 1.0


def test_a_completion_ended_by_eos_is_rewarded_as_lm_eval_scores_it(bpe, monkeypatch):
    """`Rollout.text` leaves special tokens out, as lm-eval's decode does: "13<eos>" was rewarded 0."""
    from opd.rollout import SamplingParams, get_engine

    engine = get_engine("embedded", model=build_model(PICO, bpe, seed=0), tokenizer=bpe)
    ids = bpe.encode("13", add_special_tokens=False) + [bpe.eos_token_id]
    monkeypatch.setattr(engine, "_generate_groups", lambda prompts, n, params: [(ids, [0.0] * len(ids))])
    (r,), = engine.generate(["6+7="], 1, SamplingParams(temperature=0))
    assert r.completion_ids == ids and r.text == "13"
    assert get_capability("add").verify(r.text, "13") == 1.0


def test_mergekit_keeps_the_tokenizer_and_the_newline_stop(bpe, tmp_path):
    """mergekit's tokenizer handling on a BPE lab: the merged directory holds the inputs' tokenizer
    (same hash) and their generation_config (the "\\n" stop). With `tokenizer_source: base` mergekit
    re-saved the tokenizer and dropped generation_config.json: the merge generated past its answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from opd.lab.pico import build_fake_lab
    from opd.weights.merge import Candidate, merge_in_memory, merge_keys, mergekit_config, run_mergekit

    lab = build_fake_lab(tmp_path / "lab", ("add", "rev"), tokenizer=bpe)
    experts = {n: str(p) for n, p in lab["experts"].items()}
    sds = {n: merge_keys(AutoModelForCausalLM.from_pretrained(p).state_dict()) for n, p in experts.items()}
    base_sd = merge_keys(AutoModelForCausalLM.from_pretrained(lab["base"]).state_dict())
    for cand in (Candidate(strategy="ties", shared={"density": 0.5}, per_model={"add": {"weight": 1.0}}),
                 Candidate(strategy="linear")):
        out = tmp_path / cand.strategy
        cfg = mergekit_config(cand, str(lab["base"]), experts)
        assert "tokenizer_source" not in cfg
        run_mergekit(cfg, str(out))
        assert tokenizer_hash(AutoTokenizer.from_pretrained(out)) == tokenizer_hash(bpe)
        assert GenerationConfig.from_pretrained(out).eos_token_id == [newline_id(bpe), bpe.eos_token_id]
        merged = merge_keys(AutoModelForCausalLM.from_pretrained(out).state_dict())
        assert merged["model.embed_tokens.weight"].shape[0] == len(bpe)
        for k, v in merge_in_memory(cand, base_sd, sds).items():
            torch.testing.assert_close(merged[k], v, atol=0, rtol=0)


def test_student_teacher_tokenizer_mismatch_is_refused_before_work(bpe, tmp_path, monkeypatch):
    """One line, before any model loads: a char-tokenizer teacher for a BPE student, or a student
    directory whose tokenizer is not the base's; in the merge search, an expert unlike the base."""
    import transformers

    from opd.distill.config import DistillRun
    from opd.distill.run import run_distill
    from opd.lab.pico import build_fake_lab
    from opd.merge.recipe import MergeRecipe, load_inputs

    bpe_lab = build_fake_lab(tmp_path / "bpe", ("add",), tokenizer=bpe)
    char_lab = build_fake_lab(tmp_path / "char", ("rev",))

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the tokenizers were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    runs = {
        "teacher 'rev'": DistillRun(name="x", base=str(bpe_lab["base"]), out=str(tmp_path / "o1"),
                                    teachers=[str(bpe_lab["experts"]["add"]), str(char_lab["experts"]["rev"])]),
        "the student": DistillRun(name="y", base=str(bpe_lab["base"]), out=str(tmp_path / "o2"),
                                  teachers=[str(bpe_lab["experts"]["add"])], student=str(char_lab["base"])),
    }
    for who, run in runs.items():
        with pytest.raises(OpdError, match=f"tokenizer mismatch: {who}") as e:
            run_distill(run, log=lambda *_: None)
        assert "\n" not in str(e.value) and "320 ids" in str(e.value)
    recipe = MergeRecipe(name="m", base=str(bpe_lab["base"]), experts=[str(bpe_lab["experts"]["add"]),
                                                              str(char_lab["experts"]["rev"])],
                         strategies={"linear": {}}, out=str(tmp_path / "m"))
    with pytest.raises(OpdError, match="tokenizer mismatch: expert 'rev'"):
        load_inputs(recipe)


def test_bpe_lab_end_to_end(tmp_path):
    """The whole path on a tiny BPE base, a few steps each: base, two GSPO experts, a mergekit merge,
    OPD from the merge, and lm-eval through the CLI and the API (same score); the embedded engine's
    greedy answers (id-level "\\n" stop) score what lm-eval's `until` scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from opd.distill.config import DistillRun
    from opd.distill.run import run_distill
    from opd.evaluation import api
    from opd.evaluation.heldout import heldout_items
    from opd.evaluation.tasks import REPO_EVALS
    from opd.expert.run import run_expert
    from opd.expert.spec import ExpertSpec
    from opd.lab.base import build_base
    from opd.rollout import SamplingParams, get_engine
    from opd.weights.merge import Candidate, mergekit_config, run_mergekit

    caps = ["count", "add"]
    base = tmp_path / "base"
    manifest = build_base(bpe_spec(steps=120, batch_size=32, lr=3e-3, warmup=10, eval_every=120, eval_limit=20),
                          base, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(base)
    assert manifest["tokenizer"] == "bpe" and manifest["tokenizer_hash"] == tokenizer_hash(tok) and len(tok) == 320
    experts = {}
    for cap in caps:
        spec = ExpertSpec(capability=cap, base=str(base), steps=2, eval_every=2, eval_limit=10, threads=1,
                          score_capabilities=caps, report_to="none",
                          gspo={"prompts_per_step": 4, "group_size": 4, "updates_per_batch": 1, "min_informative": 0.0})
        experts[cap] = tmp_path / "experts" / cap
        m = run_expert(spec, experts[cap])
        assert set(m["metrics"]["test"]) == set(caps)
    cand = Candidate(strategy="ties", shared={"density": 0.5})
    merged = tmp_path / "merged"
    run_mergekit(mergekit_config(cand, str(base), {c: str(p) for c, p in experts.items()}), str(merged))
    assert GenerationConfig.from_pretrained(merged).eos_token_id == [newline_id(tok), tok.eos_token_id]
    student = tmp_path / "student"
    run = DistillRun(name="s", base=str(base), teachers=[str(p) for p in experts.values()], student=str(merged),
                     out=str(student), distill={"steps": 2, "prompts_per_step": 4, "group_size": 2,
                                                "eval_limit": 10, "report_to": "none"})
    dm = run_distill(run, log=lambda *_: None)
    assert dm["train"]["steps"] == 2 and dm["train"]["gen_tokens"] > 0
    model = AutoModelForCausalLM.from_pretrained(student)
    ours = api.evaluate(model, AutoTokenizer.from_pretrained(student), ["count"], "test", use_cache=False)["count"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={student},dtype=float32",
         "--device", "cpu", "--batch_size", "128", "--include_path", str(REPO_EVALS), "--tasks", "opd_count_test",
         "--output_path", str(tmp_path / "cli")], check=True, env=env, capture_output=True, timeout=300)
    res = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    assert res["results"]["opd_count_test"]["score,none"] == pytest.approx(ours.score, abs=1e-9)
    # lm-eval's text-level `until` and the engine's id-level stop give the same answers
    items = heldout_items("add", "val")[:60]
    engine = get_engine("embedded", model=model, tokenizer=tok)
    groups = engine.generate([d["prompt"] for d in items], 1, SamplingParams(temperature=0, max_new_tokens=6))
    greedy = sum(get_capability("add").verify(g[0].text, d["answer"]) for g, d in zip(groups, items)) / len(items)
    # one item of slack: other batch shapes may flip a near-tie argmax
    assert api.evaluate(model, tok, ["add"], "val", limit=60, use_cache=False)["add"].score == \
        pytest.approx(greedy, abs=1.5 / 60)
