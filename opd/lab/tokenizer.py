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


def train_bpe_tokenizer(items: Iterable, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` ids (the 4 specials, the 256 bytes, then merges) learnt from
    lab items (`.prompt`, `.answer`). Deterministic in its input."""
    if vocab_size <= len(SPECIALS) + 256:
        raise OpdError(f"bpe_vocab_size {vocab_size}: must exceed {len(SPECIALS) + 256} (specials + 256 bytes)")
    tok = Tokenizer(models.BPE())
    # GPT-2's split: digit runs, letter runs, punctuation runs and whitespace are separate words, so
    # no merge joins "=" to an answer or "\n" to anything.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
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
