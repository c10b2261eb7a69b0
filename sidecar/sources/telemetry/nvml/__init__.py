"""GPUs through NVML (nvidia-ml-py's bindings, loaded at first use)."""
