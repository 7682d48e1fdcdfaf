"""Peer systems, each run in its own environment and talked to through a subprocess and JSON.

A peer's script runs under the peer's Python (`.venv-vllm` for vLLM, `.venv-peers` for kvpress), reads a
JSON request on stdin and writes a JSON answer on stdout; the modules that drive them (`compare_*`,
`*_agreement`, `vllm_gpu`) run in the lab's environment. `hf_generate` and `hf_quantized` run transformers,
which the lab's own environment has, in process.
"""
