"""opd: train capability experts with RL and consolidate them into one model."""

__version__ = "0.1.0"
