"""Files that hold training state on a local disk (NVMe offload)."""
