"""What a batch is to the step, whatever form it comes in.

The step's batch is a pytree of global arrays whose rows (leading dimension) are split over the `data`
mesh axis: `train_batch_size` rows in all. Users hand it over in four forms, and every entry point that
takes a batch (`Engine.step`, `evaluate`, `compile`, the memory and communication reports, the explainer,
`step_timeline`) accepts each of them through the two functions below:

- host data (numpy arrays, anything `np.asarray` takes): this process's rows of the global batch
  (all of them in a single-process run);
- a jax array this process holds whole (made with `jax.random`, `jnp.asarray`, placed on one device or
  laid out any way over this process's devices): also this process's rows; in a single-process run it is
  moved to the step's layout by one `device_put`, without a trip through the host;
- a jax array spread over several processes: the global batch, resharded if it is laid out otherwise;
- a `jax.ShapeDtypeStruct` (compile-only entry points): the global batch's shape and dtype; its own
  sharding, if any, is replaced by the step's, as `step` would reshard a concrete array.

`place` makes the step's arguments; `abstract` their shapes, dtypes and shardings without moving data.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroflax.config import ConfigError
from zeroflax.sharding.mesh import DATA_AXIS


@dataclass(frozen=True)
class BatchLayout:
    """How the step takes its batch: `rows` global rows split over `data` of `mesh`, of which this
    process feeds one of `feeders` equal blocks (1 when every process feeds the whole batch)."""
    mesh: Mesh
    rows: int
    feeders: int
    data_size: int

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA_AXIS))

    @property
    def local_rows(self) -> int:
        return self.rows // self.feeders

    def _is_global(self, x) -> bool:
        """A leaf that describes the whole batch rather than this process's rows."""
        return isinstance(x, jax.ShapeDtypeStruct) or (isinstance(x, jax.Array) and not x.is_fully_addressable)

    def check(self, batch) -> None:
        """Every leaf has the rows its form must hold; otherwise a ConfigError naming train_batch_size."""
        for x in jax.tree.leaves(batch):
            expected = self.rows if self._is_global(x) else self.local_rows
            if np.ndim(x) == 0 or np.shape(x)[0] != expected:
                form = "a global batch (jax array over several processes, or ShapeDtypeStruct)" if self._is_global(
                    x) else "this process's rows"
                raise ConfigError(
                    "Config.train_batch_size",
                    f"a batch leaf has shape {np.shape(x)}, expected {expected} rows as {form} (train_batch_size "
                    f"{self.rows} = micro_batch_size x grad_accum_steps x data-parallel size {self.data_size}, "
                    f"split over {self.feeders} process(es))",
                    "feed batches of train_batch_size examples")

    def place(self, batch):
        """The batch as the step's arguments: global arrays with rows split over `data`."""
        self.check(batch)
        sharding = self.sharding

        def leaf(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                raise TypeError("a ShapeDtypeStruct batch can be compiled (engine.compile, the reports) but not run")
            if isinstance(x, jax.Array) and (self.feeders == 1 or not x.is_fully_addressable):
                # Already global (or this process's rows are all of them): reshard on the devices,
                # a no-op when it is laid out as the step takes it.
                return x if x.sharding == sharding else jax.device_put(x, sharding)
            return jax.make_array_from_process_local_data(sharding, np.asarray(x), (self.rows,) + np.shape(x)[1:])

        return jax.tree.map(leaf, batch)

    def abstract(self, batch):
        """The step's batch arguments as ShapeDtypeStructs (global shape, dtype, the step's sharding);
        nothing is moved or run."""
        self.check(batch)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.rows,) + tuple(np.shape(x)[1:]), _dtype(x),
                                                           sharding=self.sharding), batch)

    def bytes_per_device(self, batch) -> int:
        """The batch's bytes on one device: the global batch's over the data-parallel size."""
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self.abstract(batch))) // self.data_size


def batch_share(mesh: Mesh) -> tuple[int, int]:
    """(index, count): this process feeds block `index` of the global batch's rows cut into `count`
    equal blocks, the rows of the data-axis shards its devices hold. count is the process count
    when processes split `data`; 1 when they split only other axes (a pipe axis across hosts): then
    every process feeds the whole batch."""
    data_size = mesh.shape[DATA_AXIS]
    data_dim = mesh.axis_names.index(DATA_AXIS)
    owners = np.vectorize(lambda d: d.process_index)(mesh.devices)
    mine = sorted({int(c[data_dim]) for c in np.argwhere(owners == jax.process_index())})
    per = len(mine)
    if mine != list(range(mine[0], mine[0] + per)) or data_size % per:
        raise ConfigError("MeshConfig.axes", f"this process's devices hold data shards {mine}, not one "
                          "contiguous block", "order the mesh axes so each process holds whole data blocks")
    return mine[0] // per, data_size // per


def batch_layout(mesh: Mesh, train_batch_size: int) -> BatchLayout:
    """How a step over `mesh` takes batches of `train_batch_size` rows."""
    return BatchLayout(mesh, train_batch_size, batch_share(mesh)[1], mesh.shape[DATA_AXIS])


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
