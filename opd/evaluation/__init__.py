"""Scoring with lm-evaluation-harness: task definitions over held-out items, and an in-memory API."""
