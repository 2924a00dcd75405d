"""Compact built-in capabilities a tiny model trained from scratch can learn.

Prompts are short, answers a few characters, and each task has its own prefix so one model can
hold all of them in the same weights (which is where merge interference shows). `difficulty`
mostly sets operand length.
"""

from __future__ import annotations

import random
import string

from opd.capabilities.base import Capability

LETTERS = string.ascii_lowercase


def _num(rng: random.Random, digits: int) -> int:
    return rng.randint(0, 10**digits - 1)


def _word(rng: random.Random, lo: int, hi: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def gen_add(rng, d):
    a, b = _num(rng, d), _num(rng, d)
    return f"{a}+{b}=", str(a + b)


def gen_sub(rng, d):
    a, b = sorted((_num(rng, d), _num(rng, d)), reverse=True)
    return f"{a}-{b}=", str(a - b)


def gen_mul(rng, d):
    a, b = _num(rng, d), rng.randint(2, 9)
    return f"{a}*{b}=", str(a * b)


def gen_mod(rng, d):
    a, b = _num(rng, d), rng.randint(2, 9)
    return f"{a}%{b}=", str(a % b)


def gen_rev(rng, d):
    w = _word(rng, 3, d)
    return f"r:{w}=", w[::-1]


def gen_sort(rng, d):
    w = _word(rng, 3, d, string.digits)
    return f"s:{w}=", "".join(sorted(w))


def gen_count(rng, d):
    w = _word(rng, 4, d, "abcd")
    c = rng.choice("abcd")
    return f"#{c}:{w}=", str(w.count(c))


def gen_max(rng, d):
    xs = [rng.randint(0, 99) for _ in range(d)]
    return "m:" + ",".join(map(str, xs)) + "=", str(max(xs))


def gen_shift(rng, d):
    k = rng.randint(1, 3)
    w = _word(rng, 3, d)
    return f"k{k}:{w}=", "".join(LETTERS[(LETTERS.index(ch) + k) % 26] for ch in w)


def gen_dedup(rng, d):
    # runs of repeated letters, e.g. "aabccc" -> "abc"
    out = []
    for _ in range(rng.randint(2, d)):
        ch = rng.choice([c for c in "abcdefgh" if not out or c != out[-1]])
        out.append(ch)
    w = "".join(ch * rng.randint(1, 3) for ch in out)
    return f"u:{w}=", "".join(out)


def gen_digsum(rng, d):
    w = _word(rng, 3, d, string.digits)
    return f"d:{w}=", str(sum(map(int, w)))


def gen_rot(rng, d):
    w = _word(rng, 3, d)
    k = rng.randint(1, 2)
    return f"o{k}:{w}=", w[k:] + w[:k]


BUILTIN = [
    Capability("add", "a+b for d-digit operands", gen_add, default_difficulty=2, max_new_tokens=4, prompt_space=10000),
    Capability("sub", "a-b, a>=b, d-digit operands", gen_sub, default_difficulty=2, max_new_tokens=4, prompt_space=5000),
    Capability("mul", "d-digit number times one digit", gen_mul, default_difficulty=3, max_new_tokens=6, prompt_space=8000),
    Capability("mod", "d-digit number modulo one digit", gen_mod, default_difficulty=3, max_new_tokens=3, prompt_space=8000),
    Capability("rev", "reverse a word of 3..d letters", gen_rev, default_difficulty=7, max_new_tokens=9),
    Capability("sort", "sort 3..d digits", gen_sort, default_difficulty=7, max_new_tokens=9),
    Capability("count", "count one letter in a word over abcd", gen_count, default_difficulty=10, max_new_tokens=4),
    Capability("max", "max of d two-digit numbers", gen_max, default_difficulty=4, max_new_tokens=4),
    Capability("shift", "Caesar-shift a word by k in 1..3", gen_shift, default_difficulty=6, max_new_tokens=8),
    Capability("dedup", "collapse runs of repeated letters", gen_dedup, default_difficulty=6, max_new_tokens=8),
    Capability("digsum", "sum of 3..d digits", gen_digsum, default_difficulty=6, max_new_tokens=4),
    Capability("rot", "rotate a word left by k in 1..2", gen_rot, default_difficulty=7, max_new_tokens=9),
]
