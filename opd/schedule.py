"""Learning-rate schedule: linear warmup, cosine decay to a floor."""

import math


def lr_at(step: int, total: int, peak: float, warmup: int, floor_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
