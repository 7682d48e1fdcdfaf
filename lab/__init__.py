"""Inference Lab: the key-value cache of transformer language models, built, verified and measured."""

from . import threads

threads.configure()  # before torch loads: OpenMP's threads sleep, not spin, while they wait (lab/threads.py)
