"""Inference Lab: the key-value cache of transformer language models, built, verified and measured."""
