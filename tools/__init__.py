"""Tools that are not benchmarks: gpu_env.py, the device check's offline installer (make gpu-wheels / gpu-env)."""
