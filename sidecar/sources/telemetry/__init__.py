"""What the node says about itself: the `/hardware` sampler (sampler.py) looping over its
collectors (collectors/: the host, disk usage, InfiniBand, each GPU through NVML in nvml/) on the
GPUs gpus.py chooses, /proc and sysfs read by procfs.py; the memory cgroup's OOM kills read at a
command's start and exit (cgroup.py); and the environment snapshot posted once a run
(environment.py). The pipeline (`sidecar/pipeline.py`) schedules the sampler and the snapshot;
the OOM kills and the XID events NVML reports feed the failure summary (`sidecar/diagnose.py`)."""
