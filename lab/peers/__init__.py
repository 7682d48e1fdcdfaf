"""Peer systems, each run in its own environment and talked to through a subprocess and JSON.

Nothing here is imported by `lab` itself: a peer's script runs under the peer's Python (`.venv-vllm` for
vLLM), reads a JSON request on stdin and writes a JSON answer on stdout.
"""
