"""The peer benchmark (`make bench-peers`): recsys against FBGEMM's TBE and plain PyTorch.

Runs in its own venv (.venv-peers: fbgemm-gpu-cpu, torchrec and the project),
never the project's. systems.py builds the same DLRM four ways; ab.py
replays the same loader batches through them in one process, alternating in
chunks, and measures each one's peak RSS in a process of its own.
"""
