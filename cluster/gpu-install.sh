#!/usr/bin/env bash
# The GPU install of the verl backend (docs/scaling-out.md): every node, from the checkout's root, with
# Python 3.10-3.12 and an NVIDIA driver for CUDA 13 (R580 or newer). It compiles nothing: every package comes
# as a wheel for Linux x86_64 with glibc 2.31 or newer, but for one pure-Python sdist (antlr4-python3-runtime
# 4.9.3, hydra-core's pin). Why verl's `fsdp` extra is spelled out without flash-attn, and the container
# alternative: docs/verl-plugin.md, "Installing on GPUs".
#
# This file is the one source of the install lines: docs/scaling-out.md quotes the lines between BEGIN and END
# verbatim, cluster/ray-cluster.yaml runs this file on every node, and `make check-gpu-install` (CI) resolves
# them (cluster/gpu_install.py); tests/cluster/test_gpu_install.py keeps the three in step.
set -euo pipefail
cd "$(dirname "$0")/.."
# BEGIN README
python3 -m venv .venv && . .venv/bin/activate && pip install -U pip
# verl 0.9.1 + vLLM 0.24 (torch 2.11, CUDA 13 wheels), verl's `fsdp` extra without flash-attn, then emapg,
# every package at the version CI resolved and tested (cluster/gpu-lock.txt):
pip install -e ".[verl]" "verl[verl-core,vllm]==0.9.1" "cupy-cuda13x==14.0.1" "liger-kernel>=0.8.2" \
    "trl==0.27.0" "flash-linear-attention==0.5.2" -c cluster/gpu-lock.txt
# END README
