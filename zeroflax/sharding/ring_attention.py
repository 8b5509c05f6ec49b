"""Ring attention: exact attention over a sequence split across the devices of one mesh axis, computed
in tiles (flash-attention style) so that its memory is linear in the local tokens.

Called inside a `shard_map` that is manual over the sequence axis (`axis_name`, S devices; it may be
manual over other axes too, e.g. `data`: only `axis_name` is communicated over). Each device holds
t_local tokens of q, k and v; the keys and values go round the ring while the queries stay, and the
softmax is accumulated tile by tile (online softmax), so no device ever holds more than two
devices' keys and values at once. `blockwise_attention` is the same tiled computation on one device's
whole sequence (no axis, nothing sent): usable under a plain `jit` or per device inside a shard_map.

Layout ("zigzag"). The global sequence of T tokens is cut into 2S chunks of c = T / (2S) tokens.
Device i (its `axis_index` along `axis_name`) holds chunk i followed by chunk 2S-1-i, so t_local = 2c:

    S = 4:   device 0: chunks 0, 7   device 1: chunks 1, 6   device 2: chunks 2, 5   device 3: chunks 3, 4

`zigzag_indices(T, S)` lists the global positions each device holds (device-major): gather a [B, T, ...]
array with `x[:, zigzag_indices(T, S).reshape(-1)]` and split the sequence dimension evenly over the
axis (PartitionSpec(..., axis_name, ...)) to lay it out; `zigzag_positions` gives one device's
positions inside the manual region. Without the causal mask the same layout is used (any would do).
A device's local order is its tokens' global order, so the causal mask of the local block is the
plain lower triangle of local indices.

Tiles. Every step's work is cut into square tiles of `tile` query rows x `tile` key columns, tile =
`tile_size(c, block)`: the largest divisor of c that is <= `block` (c itself when c <= block; for
`blockwise_attention` the largest divisor of T <= block). A step is a static list of its tiles,
walked by one `lax.scan`, one tile of scores at a time; each tile updates the rows (and in the backward
the key columns) of the float32 accumulators it covers. A c (or T) with no divisor near `block` (a prime)
gives small tiles and many loop iterations: choose sequence lengths with a divisor near `block`.

Work (causal). At ring step r = 0 .. S-1 device i holds the keys/values of device j = (i - r) mod S.
  r = 0 (j = i), the diagonal: the tiles on and below the diagonal of the local 2c x 2c block (n = 2c /
         tile tiles a side, n (n + 1) / 2 tiles), the causal mask applied in each (a no-op below the
         diagonal); the tiles above it (chunk i's queries against chunk 2S-1-i's keys among them) are
         never computed.
  j < i: only kv chunk j comes before the local tokens, and it comes before both local q chunks:
         all 2c query rows against the first c keys.
  j > i: both kv chunks (j and 2S-1-j) come before local chunk 2S-1-i and after local chunk i:
         the last c query rows against all 2c keys.
Either way an off-diagonal step is half of a full 2c x 2c block, the same number of tiles on every
device, so the causal ring is balanced; the step walks one of the two tile lists, chosen on the device
(j < i), and the masked half is never computed. Without the mask every step is all (2c / tile)^2 tiles
of the block. With S == 1 only the diagonal step is left: that is `blockwise_attention`.

Communication per attention layer, per device, with N = batch x t_local x heads x head_dim (the
elements of one local k block; v has as many), every transfer a `ppermute` from device i to i+1
(the tiles change none of it):
  forward:   S-1 transfers of (k, v)                        2 (S-1) N elements in k/v's dtype
             (k and v as two arrays: 2 (S-1) collective-permutes)
  backward:  S-1 transfers of (k, v) (sent round again)     2 (S-1) N elements in k/v's dtype
             S   transfers of the (dk, dv) accumulators     2 S N elements in float32
             (k and v stacked as one array, dk and dv as another: (S-1) + S collective-permutes.
             The accumulators travel with the keys they belong to, each device adding its queries'
             share, and the S-th transfer brings the finished sums back to their owner; dq stays local)
  so forward + backward moves 2 (S-1) N + 2 (S-1) N + 2 S N = (6 S - 4) N elements. With S = 1
  nothing is sent. The accumulators are float32 whatever the inputs' dtype: with bf16 inputs the
  backward sends 2 (S-1) N x 2 + 2 S N x 4 bytes.
The transfer of the next step's block is issued before the current step's compute, which does not
depend on it, so XLA may overlap the two; likewise the accumulators' transfer with the next step's
block gradients (only their sum waits for it).
Every device of the mesh must make the call at the same point of the program: XLA:CPU meets all the
devices that a collective-permute's source-target pairs name (the whole mesh: the pairs of every ring),
so in a branch that only some devices take (a pipeline stage's `lax.switch`) it waits for the others
(a deadlock, seen with a two-branch switch), or it meets a collective-permute that the other devices
run at that time, which can mix their transfers up.

Memory: linear in t_local (in T for `blockwise_attention`), never a score block wider than a tile.
Residuals: the forward is a `custom_vjp` that saves only q, k, v, the output (its dtype: 4 N elements)
and the float32 log-sum-exp of every query row per head (batch x heads x t_local): O(t_local), the
same for any S and any block. The backward recomputes the probabilities tile by tile from them.
Working set: O(tile^2) scores per tile (batch x heads x tile x tile: the scores, probabilities and in
the backward their gradients, a few such arrays) plus O(t_local) accumulators and blocks: forward, the
float32 output accumulator (N), the running max and sum, the kv block in use and the one in flight
(4 N); backward, the same kv blocks, float32 dq (N), the dk/dv accumulators in use and in flight
(4 N float32) and the step's share (2 N float32).

Logits, the running max and sum, and every accumulator are float32; scale head_dim ** -0.5; the
probabilities meet v (and the score gradients meet k and q) in the inputs' dtype with float32 accumulation,
as flash attention does; the output is cast to q's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32


def zigzag_indices(T: int, S: int) -> np.ndarray:
    """The global token positions each of S devices holds in the zigzag layout: int array [S, 2c],
    c = T / (2S), row i = chunk i then chunk 2S-1-i."""
    if S < 1 or T % (2 * S):
        raise ValueError(f"zigzag layout: the sequence length {T} must be a multiple of 2 x {S} devices")
    c = T // (2 * S)
    chunks = np.arange(T).reshape(2 * S, c)
    return np.stack([np.concatenate([chunks[i], chunks[2 * S - 1 - i]]) for i in range(S)])


def zigzag_positions(t_local: int, axis_name: str) -> jax.Array:
    """This device's global token positions (int32 [t_local]) in the zigzag layout over `axis_name`,
    inside a shard_map manual over it."""
    if t_local % 2:
        raise ValueError(f"zigzag layout: t_local {t_local} must be even (two chunks per device)")
    c = t_local // 2
    S = jax.lax.axis_size(axis_name)
    i = jax.lax.axis_index(axis_name).astype(jnp.int32)
    offsets = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([i * c + offsets, (2 * S - 1 - i) * c + offsets])


def tile_size(n: int, block: int) -> int:
    """The tile edge used for `n` rows (or columns) and a requested `block`: the largest divisor of n
    that is <= block (n itself when n <= block)."""
    if block < 1:
        raise ValueError(f"attention tiles: block must be a positive integer, got {block}")
    return max(d for d in range(1, min(n, block) + 1) if n % d == 0)


def _check_shapes(name, q, k, v):
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{name}: q, k, v must share one [batch, tokens, heads, head_dim] shape, "
                         f"got {q.shape}, {k.shape}, {v.shape}")


def ring_attention(q, k, v, axis_name: str, causal: bool = True, block: int = 512):
    """Exact (causal) softmax attention over the sequence that the devices along `axis_name` hold in
    the zigzag layout (module docstring).

    q, k, v: this device's [batch, t_local, heads, head_dim] inside a shard_map manual over
    `axis_name` (size S); t_local = 2c is even. Returns this device's output, same shape, q's dtype.
    Every ring step is computed in square tiles of `tile_size(c, block)` rows and columns (the largest
    divisor of c that is <= block), one tile of scores at a time. With S == 1 nothing is sent and this
    is `blockwise_attention` over the local tokens (with tiles that divide c).
    Differentiable (custom VJP: O(t_local) residuals, tiled recomputation in the backward)."""
    _check_shapes("ring_attention", q, k, v)
    if q.shape[1] % 2:
        raise ValueError(f"ring_attention: t_local {q.shape[1]} must be even (two zigzag chunks per device)")
    return _attention(q, k, v, axis_name, bool(causal), tile_size(q.shape[1] // 2, int(block)))


def blockwise_attention(q, k, v, causal: bool = True, block: int = 512):
    """Exact (causal) softmax attention over the whole sequence of q, k, v [batch, T, heads, head_dim]
    (the same shape; any T), on one device or per device inside a shard_map: no axis, nothing sent.
    Computed in square tiles of `tile_size(T, block)` tokens (the largest divisor of T that is <= block;
    a T whose divisors are all far below `block`, a prime, makes many small tiles: pick T with a divisor
    near `block`), one tile of scores at a time, the tiles above the causal diagonal skipped.
    Returns q's shape and dtype. Differentiable (custom VJP: O(T) residuals, the same as ring_attention's)."""
    _check_shapes("blockwise_attention", q, k, v)
    return _attention(q, k, v, None, bool(causal), tile_size(q.shape[1], int(block)))


# ---------------------------------------------------------------------------------------------------
# Tiles. Scores and probabilities are [batch, heads, q rows, k columns] of one tile; the running max, sum
# and log-sum-exp are [batch, heads, q rows]; the forward's output accumulator is [batch, heads, rows, dim].
# A ring step's work is a static list of tiles, int32 [n, 2] (first query row, first key column): a
# `lax.scan` over it takes one tile per iteration and updates the accumulators' rows (and, in the
# backward, columns) that the tile covers.

def _triangle(n, tile):
    """The tiles on and below the diagonal of an n x n grid of tiles, row by row."""
    return np.array([(r * tile, c * tile) for r in range(n) for c in range(r + 1)], np.int32).reshape(-1, 2)


def _rectangle(rows, columns, tile):
    """The tiles of rows x columns (ranges of tile indices), row by row."""
    return np.array([(r * tile, c * tile) for r in rows for c in columns], np.int32).reshape(-1, 2)


def _zeros(shape, *like, fill=0.0):
    """float32 `fill` of `shape`, typed (inside a shard_map that checks varying axes) as varying over the
    axes any of `like` varies over, as the values a loop adds to it are."""
    return jnp.full(shape, fill, _F32) + sum(jnp.zeros_like(x, shape=(), dtype=_F32) for x in like)


def _tile(x, start, size, axis):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _put(x, part, start, axis):
    return jax.lax.dynamic_update_slice_in_dim(x, part, start, axis)


def _scores(q, k, scale):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32) * scale


def _causal_mask(row, column, tile):
    """[tile, tile] True where the query (local index row + r) may see the key (column + c). The local
    order of one device's tokens is their global order (zigzag: chunk i, then the later chunk 2S-1-i)."""
    offsets = jnp.arange(tile, dtype=jnp.int32)
    return (row + offsets)[:, None] >= (column + offsets)[None, :]


def _attend_tiles(q, k, v, state, tiles, tile, scale, masked):
    """(o, m, l) updated, online softmax, with the tiles of q x (k, v) listed in `tiles` (module
    docstring); `masked`: apply the causal mask of local indices (every row of a listed tile must see
    at least one of its keys, as in a tile on or below the diagonal)."""
    def body(state, corner):
        o, m, l = state
        row, column = corner[0], corner[1]
        s = _scores(_tile(q, row, tile, 1), _tile(k, column, tile, 1), scale)
        if masked:
            s = jnp.where(_causal_mask(row, column, tile), s, -jnp.inf)
        m_old, l_old, o_old = _tile(m, row, tile, 2), _tile(l, row, tile, 2), _tile(o, row, tile, 2)
        m_new = jnp.maximum(m_old, s.max(-1))
        correction = jnp.exp(m_old - m_new)  # 0 on a row's first tile (m_old = -inf)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), _tile(v, column, tile, 1),
                        preferred_element_type=_F32)
        return (_put(o, o_old * correction[..., None] + pv, row, 2), _put(m, m_new, row, 2),
                _put(l, l_old * correction + p.sum(-1), row, 2)), None

    return jax.lax.scan(body, state, tiles)[0]


def _attend_tiles_grads(q, k, v, do, lse, delta, grads, tiles, tile, scale, masked):
    """(dq [batch, rows, heads, dim], dk, dv [batch, columns, heads, dim]) float32 `grads` plus the
    gradients of the tiles listed in `tiles`, from the rows' log-sum-exp and delta = rowsum(do * o)."""
    def body(grads, corner):
        dq, dk, dv = grads
        row, column = corner[0], corner[1]
        q_t, do_t = _tile(q, row, tile, 1), _tile(do, row, tile, 1)
        k_t, v_t = _tile(k, column, tile, 1), _tile(v, column, tile, 1)
        p = jnp.exp(_scores(q_t, k_t, scale) - _tile(lse, row, tile, 2)[..., None])
        if masked:
            p = jnp.where(_causal_mask(row, column, tile), p, 0.0)
        dv_t = jnp.einsum("bhqk,bqhd->bkhd", p.astype(do.dtype), do_t, preferred_element_type=_F32)
        dp = jnp.einsum("bqhd,bkhd->bhqk", do_t, v_t, preferred_element_type=_F32)
        ds = (p * (dp - _tile(delta, row, tile, 2)[..., None])).astype(q.dtype)
        dq_t = jnp.einsum("bhqk,bkhd->bqhd", ds, k_t, preferred_element_type=_F32) * scale
        dk_t = jnp.einsum("bhqk,bqhd->bkhd", ds, q_t, preferred_element_type=_F32) * scale
        return (_put(dq, _tile(dq, row, tile, 1) + dq_t, row, 1),
                _put(dk, _tile(dk, column, tile, 1) + dk_t, column, 1),
                _put(dv, _tile(dv, column, tile, 1) + dv_t, column, 1)), None

    return jax.lax.scan(body, grads, tiles)[0]


def _local_tiles(t, tile, causal):
    """The tiles of the local block (the ring's diagonal step, or all of blockwise attention): the lower
    triangle with the causal mask, else all of them."""
    n = t // tile
    return _triangle(n, tile) if causal else _rectangle(range(n), range(n), tile)


def _step_tiles(t, tile, causal, i, j):
    """The tiles of ring step r (the keys of device j = (i - r) mod S, j != i): without the mask all of
    them; causal, j < i: every local row against kv chunk j (the first c keys); j > i: the local rows of
    chunk 2S-1-i (the last c) against all 2c keys. The two lists are as long, so the step is one loop
    over a list chosen on the device (a select of two small constants, no branch)."""
    n = t // tile
    if not causal:
        return _rectangle(range(n), range(n), tile)
    earlier = _rectangle(range(n), range(n // 2), tile)
    later = _rectangle(range(n // 2, n), range(n), tile)
    return jnp.where(j < i, earlier, later)


def _shift(x, axis_name, S):
    """x of device i sent to device i+1 (mod S)."""
    return jax.lax.ppermute(x, axis_name, [(d, (d + 1) % S) for d in range(S)])


def _ring_steps(step, kv, axis_name, S, carry):
    """`carry` after `step(carry, kv_r, r)` for r = 1 .. S-1, where kv_r is device (i - r)'s `kv`:
    S-1 transfers from the left neighbour, the one for step r+1 issued before step r computes (a loop
    over the middle steps, the last one outside it so that nothing is sent after it).

    On the CPU the middle steps are unrolled instead (`lax.platform_dependent`, decided when the step is
    lowered): XLA:CPU from jaxlib 0.11 on runs a loop that holds collectives beside the collectives
    outside it, and all of a shard_map's collectives share one rendezvous key there, so a device can pair
    a ring transfer with another collective (at ZeRO stage 3, a layer's weight gather). That aborted
    tests/test_sequence.py's stage-3 ring case within 30 steps in 3 of 3 runs; unrolled, none in 3 runs
    of 300 (docs/perf.md). Elsewhere the loop stays: the program does not grow with the ring (unrolled, the
    step of that case compiled 1.25x slower at S = 8)."""
    if S == 1:
        return carry
    kv = _shift(kv, axis_name, S)
    if S > 2:
        def body(r, loop_carry):
            kv_r, inner = loop_carry
            return _shift(kv_r, axis_name, S), step(inner, kv_r, r)

        def unrolled(kv, carry):
            for r in range(1, S - 1):
                kv, carry = body(r, (kv, carry))
            return kv, carry

        looped = lambda kv, carry: jax.lax.fori_loop(1, S - 1, body, (kv, carry))
        kv, carry = jax.lax.platform_dependent(kv, carry, cpu=unrolled, default=looped)
    return step(carry, kv, S - 1)


def _ring(axis_name):
    """(S, this device's index): (1, 0) without an axis (blockwise_attention)."""
    if axis_name is None:
        return 1, 0
    return jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)


# ---------------------------------------------------------------------------------------------------
# Forward.

def _forward(q, k, v, axis_name, causal, tile):
    """(output in q's dtype, float32 log-sum-exp [batch, heads, t_local])."""
    S, i = _ring(axis_name)
    b, t, h, d = q.shape
    scale = d ** -0.5
    state = (_zeros((b, h, t, d), q, k, v), _zeros((b, h, t), q, k, v, fill=-jnp.inf), _zeros((b, h, t), q, k, v))
    state = _attend_tiles(q, k, v, state, _local_tiles(t, tile, causal), tile, scale, masked=causal)

    def step(state, kv, r):
        k_r, v_r = kv
        return _attend_tiles(q, k_r, v_r, state, _step_tiles(t, tile, causal, i, (i - r) % S), tile, scale,
                             masked=False)

    o, m, l = _ring_steps(step, (k, v), axis_name, S, state)
    out = (o / l[..., None]).transpose(0, 2, 1, 3).astype(q.dtype)
    return out, m + jnp.log(l)


# ---------------------------------------------------------------------------------------------------
# Backward.

def _backward(axis_name, causal, tile, residuals, do):
    q, k, v, out, lse = residuals
    S, i = _ring(axis_name)
    t = q.shape[1]
    scale = q.shape[-1] ** -0.5
    do = do.astype(q.dtype)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(_F32), out.astype(_F32))

    def zeros():
        return _zeros(k.shape, q, k, v, do)

    dq, dk, dv = _attend_tiles_grads(q, k, v, do, lse, delta, (zeros(), zeros(), zeros()),
                                     _local_tiles(t, tile, causal), tile, scale, masked=causal)
    if S == 1:
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    def contribution(dq, kv, r):
        """(dq updated, this device's share of the kv block of step r's gradient: float32 [2, *k.shape],
        dk then dv; zero for the keys that none of this device's queries see)."""
        dq, dk_r, dv_r = _attend_tiles_grads(q, kv[0], kv[1], do, lse, delta, (dq, zeros(), zeros()),
                                             _step_tiles(t, tile, causal, i, (i - r) % S), tile, scale,
                                             masked=False)
        return dq, jnp.stack([dk_r, dv_r])

    # The (dk, dv) accumulator of the kv block a device holds at step r arrives from the left neighbour
    # beside (not inside) that block's transfer: computing this device's share needs only the block,
    # adding it needs the accumulator, and the sum goes on to the right.
    def step(carry, kv, r):
        dq, acc = carry
        dq, part = contribution(dq, kv, r)
        return dq, _shift(acc + part, axis_name, S)

    # k and v travel as one stacked array here (two arrays in the forward): the backward's first
    # transfer is then not the forward's first one, which XLA would otherwise merge with it (the same
    # ppermute of the same arrays when forward and backward are in one program), keeping the
    # neighbour's k and v alive from the forward to the backward, 2 N more per layer than the residuals.
    kv = jnp.stack([k, v])
    dq, acc = _ring_steps(step, kv, axis_name, S, (dq, _shift(jnp.stack([dk, dv]), axis_name, S)))
    # After step S-1 each device sent on the finished sums of device i+1's keys: they are home.
    return dq.astype(q.dtype), acc[0].astype(k.dtype), acc[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, axis_name, causal, tile):
    return _forward(q, k, v, axis_name, causal, tile)[0]


def _attention_fwd(q, k, v, axis_name, causal, tile):
    out, lse = _forward(q, k, v, axis_name, causal, tile)
    return out, (q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _backward)
