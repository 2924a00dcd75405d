"""opd.rl: the RL maths both training loops share (the GSPO expert loop in opd.expert, the OPD loop
in opd.distill), pure tensor functions and batching that know nothing of either loop.

- `gspo_loss`: GSPO / GSPO-token loss, group advantages, k3 KL, truncated importance weights.
- `distill_loss`: reverse-KL distillation maths (teacher mixing, sampled-token advantages).
- `batch`: rollouts into padded tensors, per-token logprobs, prompts run once per group.
- `packing`: rows laid out padded or packed (no padding, a group's prompt once) for one forward.
- `preference_loss`, `reward_fit`: the Bradley-Terry loss and the loop that fits a learned-reward
  capability's reward model with it.
- `distributed`: the DeepSpeed ZeRO engine, its config fragment, and the rank helpers.
"""
