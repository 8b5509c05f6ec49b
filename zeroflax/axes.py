"""The mesh axis names, defined once: ZeRO's data-parallel axis, the pipeline's and tensor slicing's."""
DATA_AXIS = "data"  # data parallelism; ZeRO partitions over it and no logical rule may map to it
PIPE_AXIS = "pipe"  # pipeline stages: the stacked layers are split over it
TENSOR_AXIS = "tensor"  # tensor slicing (Megatron), left to XLA's partitioner inside the step
