"""The lab's tokenizers, built locally with `tokenizers` and saved as PreTrainedTokenizerFast:
one id per character (`char`), or a byte-level BPE trained on the lab's own training stream (`bpe`).

How text becomes ids, the same everywhere (pre-training, rollouts, teacher scoring, lm-eval): a
prompt is encoded alone, an answer (or a sampled completion) continues from the prompt's ids, and
the concatenated text is never re-tokenized. The BPE is trained on prompts and answers as separate
strings, so no merge spans the prompt/answer boundary, and "\\n" (which ends every answer) is one
token that no other token contains: the engines' id-level stop and lm-eval's text-level `until`
cut an answer at the same place.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from opd.errors import OpdError

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + "+-*/%=:,.#<>?|()[] \n"
# Minimal template so chat-style callers work; the lab tasks themselves are raw prompts.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
)
# Qwen2/3's pre-tokenizer split, copied from transformers' models/qwen2/tokenization_qwen2.py
# (PRETOKENIZE_REGEX): "\p{N}" makes every digit its own word.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
BPE_CORPUS_ITEMS = 20_000  # training-stream items the BPE learns its merges from (well under a second)


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def train_bpe_tokenizer(items: Iterable, vocab_size: int, split: str = "qwen2") -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` ids (the 4 specials, the 256 bytes, then merges) learnt from
    lab items (`.prompt`, `.answer`). Deterministic in its input.

    `split` is the pre-tokenizer, which decides what a merge may join. 'qwen2': Qwen2/3's own
    (`PRETOKENIZE_REGEX` in transformers' models/qwen2/tokenization_qwen2.py, then a ByteLevel
    without its regex, as that tokenizer builds it): every digit is its own word, so numbers are
    spelt digit by digit, and letter runs merge. 'gpt2': GPT-2's split, where digit runs merge too
    ("124" -> "12", "4"): the lab's arithmetic answers then take arbitrary chunkings, which a
    1.6M-parameter model barely learns (the README's BPE section has the measurements). Both keep
    letters, digits, punctuation and newlines in separate words, so no merge joins "=" to an answer
    or "\n" to anything (checked below)."""
    if vocab_size <= len(SPECIALS) + 256:
        raise OpdError(f"bpe_vocab_size {vocab_size}: must exceed {len(SPECIALS) + 256} (specials + 256 bytes)")
    tok = Tokenizer(models.BPE())
    if split == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise OpdError(f"bpe_split {split!r}: choose 'qwen2' or 'gpt2'")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # prompt and answer+"\n" as separate strings: they are encoded separately everywhere
    tok.train_from_iterator((s for it in items for s in (it.prompt, it.answer + "\n")), trainer)
    fast = _wrap(tok)
    nl = newline_id(fast)
    joined = sorted(t for t, i in fast.get_vocab().items() if i != nl and "\n" in fast.decode([i]))
    if joined:  # the engines stop on the "\n" id: a token holding more than "\n" would run past the answer
        raise OpdError(f"bpe tokenizer: tokens {joined[:5]} join '\\n' to other text")
    return fast


def newline_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The one id that encodes "\\n" (answers end there). Not `convert_tokens_to_ids("\\n")`: a
    byte-level vocabulary spells the token "Ċ", and the lookup returns <unk>."""
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise OpdError(f"tokenizer: '\\n' encodes to {len(ids)} ids {ids}; the lab needs it as one token")
    return ids[0]
