"""ZeRO-Infinity's update: the master weights and optimizer state live in a file (`OffloadOptimizerConfig.device
= 'nvme'`), and each step streams them through a few host buffers.

The step's compiled program ends with the reduced gradient shards (kept in `TrainState.pending_grads`, on the
device) and their norm; it never sees the master weights. Then, on the host (`finish`), chunk by chunk
(`disk/chunks.py`: rows of one device's shard of one leaf):

  1. the chunk's record (master weights, then the leaf's optimizer slots) is read into a buffer, the next
     ones read ahead by the I/O threads (`disk/files.py: Streamer`);
  2. its gradient rows come from the device, clipped by the step's global norm as `clip_to` clips;
  3. the optimizer updates the chunk on the host CPU, the other leaves standing as empty arrays in the
     optimizer's tree (so the state's structure, masks and step counts are the user's own);
  4. the new values go back into the buffer, which is written behind; the chunk's compute-dtype copy
     goes to its devices' copy of the parameters, in place.

This equals the update over the whole tree for an optimizer that acts on each element alone, which is
checked when the engine is built (`zeroflax/optim/chunked.py: check_elementwise`): a trust ratio (LAMB), a factored moment
(Adafactor) or a global-norm clip inside the optimizer are refused with the key to change. The host
holds the buffers, one chunk's update and the optimizer's shared leaves (its step counts), whatever the
model's size. docs/offload.md, "NVMe".
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.disk.chunks import ChunkLayout, chunk_layout, views
from zeroflax.disk.store import StateStore
from zeroflax.optim.chunked import chunk_init, chunk_update
from zeroflax.optim.clipping import global_norm
from zeroflax.sharding.padding import fit, stored_shape, to_true
from zeroflax.step.offloaded_update import OffloadedUpdate, on_device
from zeroflax.step.parts import Updated
from zeroflax.step.phases import STEADY


@dataclasses.dataclass(frozen=True)
class StreamedUpdate(OffloadedUpdate):
    """The update part with the state on disk (`zeroflax.step.parts.Update`). Its TrainState fields:
    `compute_params` (the device's copy, as under offload) and `pending_grads` (the step's reduced gradient
    shards, until `finish` applies them); `params` and `opt_state` are None: they are in the file."""

    phases = (STEADY,)

    # ---------------------------------------------------------------------------- what it keeps where
    @functools.cached_property
    def _abstract_opt(self):
        return jax.eval_shape(self.optimizer.init, self.plan.abstract_params)

    @functools.cached_property
    def layout(self) -> ChunkLayout:
        return chunk_layout(self.plan.abstract_params, self._abstract_opt, self.plan.params, self.optimizer,
                            self.config.offload_optimizer.buffer_size)

    @functools.cached_property
    def store(self) -> StateStore:
        offload = self.config.offload_optimizer
        directory = os.path.join(offload.nvme_path, f"process_{jax.process_index()}")
        return StateStore(directory, self.layout, buffer_count=offload.buffer_count, io_threads=offload.io_threads,
                          direct=offload.direct_io)

    @functools.cached_property
    def _cpu(self):
        return jax.local_devices(backend="cpu")[0]

    @functools.cached_property
    def _programs(self) -> dict:
        return {}

    def _jitted(self, what: str, leaf: int):
        """The jitted chunk update or init of `leaf` (jit compiles once per chunk shape)."""
        if (what, leaf) not in self._programs:
            slots, shared = self.layout.slots, self.layout.shared
            if what == "update":
                fn = chunk_update(self.optimizer, self.plan.abstract_params, self._abstract_opt, slots, shared, leaf,
                                  self.config.grad_clip, self.config.compute_dtype)
            else:
                fn = chunk_init(self.optimizer, self.plan.abstract_params, self._abstract_opt, slots, shared, leaf)
            self._programs[what, leaf] = jax.jit(fn)
        return self._programs[what, leaf]

    def field_shardings(self) -> dict:
        return {"params": None, "opt_state": None, "compute_params": self.plan.compute,
                "pending_grads": on_device(self.plan.host_grads)}

    def abstract_fields(self, abstract_params) -> dict:
        return {"params": None, "opt_state": None, "compute_params": jax.eval_shape(self.compute_copy, abstract_params),
                "pending_grads": abstract_params}

    def init_fields(self, params) -> dict:
        """No pending gradients yet: `refreshed` makes them once the initial master weights are gone."""
        return {"pending_grads": None}

    def _zero_grads(self):
        zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self.plan.stored("grads"))
        return jax.jit(zeros, out_shardings=on_device(self.plan.host_grads))()

    @functools.cached_property
    def _fresh_copy(self) -> dict:
        return {}

    def initial(self, params, opt_init):
        """Writes the file from the initial master weights `params` (stored, partitioned), each chunk's optimizer
        state made on the host from its master, and returns (None, None). Leaf by leaf, once its chunks are
        written, its compute copy is made and the leaf deleted, so that the host never holds the master
        weights and their copy whole at once (`refreshed` takes the copy)."""
        store = self.store
        store.create()
        leaves = jax.tree.leaves(params)
        left = [0] * len(leaves)  # chunks of each leaf not yet written
        for chunk in self.layout.chunks:
            left[chunk.leaf] += 1
        copies = [None] * len(leaves)
        stream = store.streamer()
        shared_values = None
        try:
            for index, chunk in enumerate(self.layout.chunks):
                buf = stream.buffer()
                np.frombuffer(buf, np.uint8)[:] = 0  # the gaps between parts too: the file's bytes are deterministic
                v = views(chunk, buf)
                v[-1][...] = self._device_rows(leaves[chunk.leaf], chunk)
                # np.asarray waits for the init, which reads the master through device_put's alias of the buffer.
                slot_values, shared_now = self._jitted("init", chunk.leaf)(jax.device_put(v[-1], self._cpu))
                for j, value in zip(self.layout.slots[chunk.leaf], slot_values):
                    v[j][...] = np.asarray(value)
                shared_values = shared_values if shared_values is not None else shared_now
                stream.write_new(index, buf)
                left[chunk.leaf] -= 1
                if not left[chunk.leaf]:
                    copies[chunk.leaf] = self._leaf_copy(chunk.leaf, leaves[chunk.leaf])
                    leaves[chunk.leaf].delete()
            stream.drain()
        finally:
            stream.close()
        for i, leaf in enumerate(leaves):  # a leaf without chunks (no element on this process)
            if copies[i] is None:
                copies[i] = self._leaf_copy(i, leaf)
        if shared_values is None:  # no chunk at all (no parameters on this process)
            opt = jax.tree.leaves(jax.eval_shape(self.optimizer.init, self.plan.abstract_params))
            shared_values = [np.zeros(opt[j].shape, opt[j].dtype) for j in self.layout.shared]
        store.commit(0, [np.asarray(x) for x in shared_values])
        self._fresh_copy["compute_params"] = jax.tree.unflatten(jax.tree.structure(params), copies)
        return None, None

    def _leaf_copy(self, i: int, leaf):
        """The compute copy of one initial master leaf, laid out as `plan.compute` has it."""
        abstract = jax.tree.leaves(self.plan.abstract_params)[i]
        target = jax.tree.leaves(self.plan.compute)[i]
        on_device_ = jax.tree.leaves(on_device(self.plan.params))[i]  # the master is in host memory

        def copy(x):
            x = jax.device_put(x, on_device_)
            return fit(x.astype(self._copy_dtype(x)), abstract, target)

        return jax.jit(copy, out_shardings=target)(leaf)

    # ------------------------------------------------------------------------------------ reading
    def _device_rows(self, array, chunk):
        """The chunk's true elements of a device array laid out as the master weights (its first device's shard)."""
        shard = next(s for s in array.addressable_shards if s.device == chunk.devices[0])
        if not chunk.box:
            return np.asarray(shard.data)
        rows = slice(chunk.shard_rows, chunk.shard_rows + chunk.box[0])
        return np.asarray(shard.data[(rows,) + tuple(slice(0, n) for n in chunk.box[1:])])

    def read_master(self):
        """The master weights read from this process's file, as global arrays laid out as the plan's master
        weights on the device (each device's shard assembled from its chunks, zeros in the padding); what
        `Engine.model_params` and exports read. Every process of a run reads its own file."""
        store, leaves = self.store, jax.tree.leaves(self.plan.abstract_params)
        store.step()  # refuses a mixed state
        shardings = jax.tree.leaves(on_device(self.plan.params))
        shards = []  # per leaf: device -> its shard (host)
        for x, sharding in zip(leaves, shardings):
            stored = stored_shape(x.shape, sharding)
            shards.append({d: np.zeros(tuple(len(range(*i.indices(n))) for i, n in zip(index, stored)), x.dtype)
                           for d, index in sharding.addressable_devices_indices_map(stored).items()})
        stream = store.streamer()
        try:
            for index, buf in stream.reads(range(len(self.layout.chunks))):
                chunk = self.layout.chunks[index]
                rows = views(chunk, buf)[-1]
                where = ((slice(chunk.shard_rows, chunk.shard_rows + chunk.box[0]),)
                         + tuple(slice(0, n) for n in chunk.box[1:])) if chunk.box else ()
                for device in chunk.devices:
                    shards[chunk.leaf][device][where] = rows
                stream.release(buf)
        finally:
            stream.close()
        arrays = [jax.make_array_from_single_device_arrays(
            stored_shape(x.shape, s), s, [jax.device_put(a, d) for d, a in per_device.items()])
            for x, s, per_device in zip(leaves, shardings, shards)]
        return jax.tree.unflatten(jax.tree.structure(self.plan.abstract_params), arrays)

    # ------------------------------------------------------------------------- the Update protocol
    def loss_params(self, state):
        """The compute copy upcast to the master dtype (the gradients are reduced in it, as under offload)."""
        return jax.tree.map(lambda c, a: c.astype(a.dtype), state.compute_params, self.plan.abstract_params)

    def readable(self, state):
        return self.loss_params(state)

    def master(self, state):
        return self.read_master()

    def refreshed(self, state):
        """The compute copy made from the master weights: at initialisation the one `initial` made, else from the
        file, streamed chunk by chunk; with zero pending gradients if the state has none."""
        if state.pending_grads is None:
            state = state.replace(pending_grads=self._zero_grads())
        if "compute_params" in self._fresh_copy:
            return state.replace(params=None, opt_state=None, compute_params=self._fresh_copy.pop("compute_params"))
        self.store.step()  # refuses a mixed state
        copies = self._copy_shards(None)
        stream = self.store.streamer()
        try:
            for index, buf in stream.reads(range(len(self.layout.chunks))):
                chunk = self.layout.chunks[index]
                # A copy: on the CPU device_put would alias the buffer, which is read again once released.
                master = jax.device_put(np.array(views(chunk, buf)[-1]), self._cpu)
                self._put_copy(copies[chunk.leaf], chunk, master.astype(self._copy_dtype(master)))
                stream.release(buf)
        finally:
            stream.close()
        return state.replace(opt_state=None, compute_params=self._assemble(copies))

    def restored(self, state):
        """A restored state (its files restored from the checkpoint's snapshot): the compute copy from the
        file, and zero pending gradients."""
        state = self.refreshed(state) if state.compute_params is None else state
        return state if state.pending_grads is not None else state.replace(pending_grads=self._zero_grads())

    def stored(self, state):
        """What a checkpoint's arrays hold: neither the compute copy nor the pending gradients (the file's
        snapshot holds the master weights and optimizer state)."""
        return state.replace(compute_params=None, pending_grads=None)

    def __call__(self, state, synced, phase: str):
        """In the compiled step: the reduced gradients kept for `finish`, their norm and finiteness."""
        if synced.norm is not None or synced.extra:
            raise ValueError("the streamed update takes plain reduced gradients")
        grads = jax.lax.with_sharding_constraint(synced.grads, on_device(self.plan.host_grads))
        norm = global_norm(to_true(grads, self.plan.abstract_params))
        fields = {"compute_params": state.compute_params, "pending_grads": grads}
        return Updated(None, None, norm, jnp.isfinite(norm), fields)

    def finish(self, state, metrics):
        """After the compiled step: the update streamed through the file (see the module docstring). Returns
        the state with the new compute copy."""
        store, layout = self.store, self.layout
        step = int(state.step)
        held = store.step()
        if held != step - 1:
            raise ValueError(f"{store.directory} holds the state after step {held}, but this TrainState is at step "
                             f"{step - 1}: pass the newest state the engine returned, or restore a checkpoint")
        norm = np.float32(metrics["grad_norm"])
        if self.skips_nonfinite and not np.isfinite(norm):  # skipped: the file stays as it is
            store.begin(step)
            store.commit(step, store.shared())
            return state
        grads = jax.tree.leaves(state.pending_grads)
        copies = self._copy_shards(state.compute_params)
        shared_in = tuple(jax.device_put(x, self._cpu) for x in store.shared())
        shared_out = shared_in
        store.begin(step)
        moved = store.bytes_moved
        stream = store.streamer()
        try:
            for index, buf in stream.reads(range(len(layout.chunks))):
                chunk = layout.chunks[index]
                v = views(chunk, buf)
                slots = layout.slots[chunk.leaf]
                # On the CPU device_put aliases the buffer's views: the np.asarray below waits for the update, so
                # it has read them before they are overwritten.
                to_cpu = lambda x: jax.device_put(x, self._cpu)
                master, new_slots, shared_now, copy = self._jitted("update", chunk.leaf)(
                    to_cpu(v[-1]), tuple(to_cpu(v[j]) for j in slots), shared_in,
                    to_cpu(self._device_rows(grads[chunk.leaf], chunk)), norm)
                v[-1][...] = np.asarray(master)
                for j, value in zip(slots, new_slots):
                    v[j][...] = np.asarray(value)
                stream.write(index, buf)
                shared_out = shared_now
                self._put_copy(copies[chunk.leaf], chunk, copy)
            stream.drain()
        finally:
            stream.close()
        store.commit(step, [np.asarray(x) for x in shared_out])
        read, written = store.bytes_moved
        self._traffic.update(read=read - moved[0], written=written - moved[1])
        return state.replace(compute_params=self._assemble(copies))

    # ---------------------------------------------------------------------------- its theory (reports)
    @functools.cached_property
    def _traffic(self) -> dict:
        return {}

    def disk_traffic(self) -> tuple[int, int] | None:
        """(read, written) bytes of this process's file in the last step it streamed; None before one."""
        return (self._traffic["read"], self._traffic["written"]) if self._traffic else None

    def disk_traffic_theory(self) -> tuple[int, int]:
        """(read, written) bytes per step of this process's file in theory (`disk_theory`)."""
        return disk_theory(self.layout)

    def disk_at_rest(self) -> int:
        """Bytes of this process's file on disk (the records' aligned extents; 0 before it exists)."""
        return self.store.file_bytes()

    def host_buffer_bytes(self) -> int:
        """The host memory the stream's buffers take (per process)."""
        return self.store.buffer_bytes

    def host_traffic_theory(self, abstract_params, phase: str = STEADY) -> tuple[float, float]:
        """Nothing moves between host and device inside the compiled step: the gradient rows and the compute
        copy's chunks move in `finish`, chunk by chunk."""
        return 0.0, 0.0

    # ------------------------------------------------------------------------- the compute copy
    @functools.cached_property
    def _shard_layout(self):
        """The master weights' layout on the device, in the compute dtype (stage 3: the compute copy's own)."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(stored_shape(x.shape, s), self._copy_dtype(x), sharding=s),
                            self.plan.abstract_params, on_device(self.plan.params))

    def _copy_dtype(self, x):
        return self.config.compute_dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype

    def _copy_shards(self, compute_params):
        """Per leaf: device -> its single-device array of the copy being rebuilt, in the master's layout (at
        stage 3 that of `compute_params`, rewritten in place; else zeros)."""
        if self.config.zero_stage == 3 and compute_params is not None:
            arrays = jax.tree.leaves(compute_params)
        else:
            zeros = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self._shard_layout),
                            out_shardings=jax.tree.map(lambda x: x.sharding, self._shard_layout))
            arrays = jax.tree.leaves(zeros())
        return [{s.device: s.data for s in a.addressable_shards} for a in arrays]

    @functools.cached_property
    def _write_rows(self):
        return jax.jit(lambda target, rows, start: jax.lax.dynamic_update_slice(target, rows, start), donate_argnums=0)

    def _put_copy(self, shards: dict, chunk, copy) -> None:
        start = (chunk.shard_rows,) + (0,) * (len(chunk.box) - 1) if chunk.box else ()
        for device in chunk.devices:
            rows = jax.device_put(copy, device)
            shards[device] = self._write_rows(shards[device], rows, tuple(np.int32(s) for s in start)) if chunk.box \
                else rows.astype(shards[device].dtype)

    def _assemble(self, copies):
        layout = jax.tree.leaves(self._shard_layout)
        arrays = [jax.make_array_from_single_device_arrays(x.shape, x.sharding, list(d.values()))
                  for x, d in zip(layout, copies)]
        tree = jax.tree.unflatten(jax.tree.structure(self.plan.abstract_params), arrays)
        if self.config.zero_stage == 3:
            return tree
        return self._jit_gather(tree)

    @functools.cached_property
    def _jit_gather(self):
        return jax.jit(lambda t: fit(self.gather_compute_copy(t), self.plan.abstract_params, self.plan.compute),
                       out_shardings=self.plan.compute)


def disk_theory(layout: ChunkLayout) -> tuple[int, int]:
    """(read, written) bytes per step per process, ZeRO-Infinity's figure: this process's master weights and
    optimizer state, (b_master + K) x its parameters (true elements; a shard its devices share counted once),
    read once and written once. The file moves more by its alignment: each record is a whole number of
    4096-byte blocks (and each part of a record 64-byte aligned), which a chunk of `buffer_size` elements
    makes small."""
    total = sum(chunk.elements * sum(dtype.itemsize for _, dtype, _ in chunk.parts) for chunk in layout.chunks)
    return total, total


