"""opd.rollout"""
