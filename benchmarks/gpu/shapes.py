"""The shapes the GPU pass measures (benchmarks/gpu/pass.sh), in one place: the pass's parts read them, and
tests/test_cuda_lowering.py lowers every Pallas kernel for CUDA at exactly these shapes on the CPU machine,
so a kernel that the pass would run cannot stop lowering unnoticed. Plain data: importing this module
imports nothing else.
"""

# Block-sparse attention (part d): bf16 q, k, v of [batch, length, heads, head_dim].
SPARSE_BATCH = 1
SPARSE_HEADS = 16
SPARSE_HEAD_DIMS = (64, 128)
SPARSE_BLOCK = 64
# Bidirectional LocalSlidingWindow widths (in blocks of SPARSE_BLOCK) that give the layout's density
# closest to 10%: 9.9% at 8k, 10.3% at 16k, 10.1% at 32k (the layout's mean, measured).
SPARSE_WINDOWS = {8192: 13, 16384: 27, 32768: 53}
SPARSE_LENGTHS = tuple(SPARSE_WINDOWS)

# 1-bit Adam's sign packing (part b): 100M float32 elements as rows x columns (the exchange's layout:
# one row per server chunk). 8 rows of 12.5M columns (a multiple of 8: packed 8 signs to a byte).
ONEBIT_ROWS = 8
ONEBIT_COLS = 12_500_000

# The same parts at SMOKE=1 on the CPU (Pallas interpret mode): shapes that finish in seconds.
SMOKE_SPARSE_LENGTHS = {256: 3}
SMOKE_SPARSE_BLOCK = 16
SMOKE_SPARSE_HEADS = 2
SMOKE_SPARSE_HEAD_DIMS = (64,)
SMOKE_ONEBIT_ROWS = 2
SMOKE_ONEBIT_COLS = 4096

# ---- Added for the pass's other parts (benchmarks/gpu/pass.sh); the constants above are unchanged.
# 1-bit Adam (part b) also runs at the column count rounded up to a whole number of kernel blocks
# (8 * BLOCK_GROUPS = 2048 columns): ONEBIT_COLS = 12.5M is 6103.5 blocks, so there the Pallas path pads
# its inputs (one extra copy); the aligned shape shows what the kernels do without it.
ONEBIT_ALIGNED_COLS = 12_500_992  # 6104 * 2048
SMOKE_ONEBIT_ALIGNED_COLS = 4096  # = SMOKE_ONEBIT_COLS: already aligned (the pass skips the duplicate)
# The probe's ceilings (part a): a bf16 matrix product N x N x N on random data, and a device-to-device
# copy of COPY_BYTES (read once, written once: 2 x COPY_BYTES moved).
MATMUL_N = 8192
COPY_BYTES = 2 * 2**30
SMOKE_MATMUL_N = 256
SMOKE_COPY_BYTES = 8 * 2**20
# Host <-> device transfers (part c): bytes per transfer.
HOST_TRANSFER_BYTES = (256 * 2**20, 2**30)
SMOKE_HOST_TRANSFER_BYTES = (4 * 2**20,)
# The GPT sizes of part e, in the order they run (train_mfu.py's names), and part f's model (offload.py's
# 1.3B: 24 layers at d 2048).
MFU_SIZES = ("1.3b", "350m", "125m")
OFFLOAD_RATIO_LAYERS = 24
