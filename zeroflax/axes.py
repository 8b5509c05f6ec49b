"""The mesh axis names, defined once: ZeRO's data-parallel axis, the pipeline's, tensor slicing's and the
sequence's (long sequences split over devices: zeroflax/sharding/sequence.py)."""
DATA_AXIS = "data"  # data parallelism; ZeRO partitions over it and no logical rule may map to it
PIPE_AXIS = "pipe"  # pipeline stages: the stacked layers are split over it
TENSOR_AXIS = "tensor"  # tensor slicing (Megatron), left to XLA's partitioner inside the step
SEQUENCE_AXIS = "sequence"  # each example's tokens split over it; ZeRO partitions over `data` x `sequence`
