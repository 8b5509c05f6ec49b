"""Export a checkpoint's parameters to safetensors, and start from such a file (docs/export.md).

    zeroflax export --checkpoint runs/gpt_tiny --format safetensors [--dtype bf16] [--out FILE] [--step N]

The parameters of a checkpoint written at any ZeRO stage, on any mesh, are restored whole onto one CPU
device (checkpoints hold global arrays) and written with `safetensors.numpy.save_file`, so numpy, PyTorch
(`safetensors.torch.load_file`) or any other safetensors reader loads them without jax or zeroflax.

Naming scheme ("zeroflax-v1"):
- a leaf's name is its path in the parameter tree, keys joined with "." (`embed`, `ln_f_scale`);
- a stacked leaf (one whose first logical axis is 'layers', as the GPT's scanned layers are) is written
  as one tensor per layer, without the leading layer dimension: `layers.{i}.{path}` (`layers.3.w_qkv`).
  The file's metadata lists the stacked paths (`zeroflax.stacked`), so `load_safetensors` re-stacks them.
`__metadata__` (strings only, as safetensors requires) holds `zeroflax.model` (the GPTConfig JSON from the
checkpoint's meta), `zeroflax.step`, `zeroflax.version`, `zeroflax.naming`, `zeroflax.stacked` (JSON
list) and `zeroflax.dtype`.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from zeroflax.config import ConfigError

NAMING = "zeroflax-v1"
LAYER_PREFIX = "layers"
DTYPES = ("fp32", "bf16", "fp16")


def _numpy_dtype(dtype: str | None):
    if dtype in (None, "fp32"):
        return None  # keep the stored dtype (fp32 master weights)
    if dtype == "bf16":
        import ml_dtypes  # a jax dependency: numpy has no bfloat16, and safetensors.numpy writes ml_dtypes' as BF16
        return np.dtype(ml_dtypes.bfloat16)
    if dtype == "fp16":
        return np.dtype(np.float16)
    raise ConfigError("--dtype", f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")


def _floating(dtype) -> bool:
    import jax.numpy as jnp
    return jnp.issubdtype(dtype, jnp.floating)  # numpy's issubdtype does not count ml_dtypes' bfloat16


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree) -> list[str]:
    """Each leaf's tree path with its keys joined by "." (in jax's leaf order)."""
    import jax
    paths = [".".join(_key_name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if len(set(paths)) != len(paths):  # a key holding "." could make two paths one name
        raise ConfigError("parameters", "two parameter paths give the same tensor name when joined with '.'")
    return paths


def stacked_paths(tree, names) -> list[str]:
    """The paths of the leaves whose first logical axis is 'layers' (`names`: `zeroflax.unbox`'s second value)."""
    import jax
    if names is None:
        return []
    axes = jax.tree_util.tree_structure(tree).flatten_up_to(names)
    return [path for path, a in zip(leaf_paths(tree), axes) if a and a[0] == LAYER_PREFIX]


def to_tensors(params, stacked=()) -> dict[str, np.ndarray]:
    """The flat {name: array} of a parameter tree of host arrays under the naming scheme."""
    import jax
    stacked, out = set(stacked), {}
    for path, leaf in zip(leaf_paths(params), jax.tree.leaves(params)):
        leaf = np.asarray(leaf)
        if path in stacked:
            for i in range(leaf.shape[0]):
                out[f"{LAYER_PREFIX}.{i}.{path}"] = np.ascontiguousarray(leaf[i])
        else:
            out[path] = leaf
    return out


def checkpoint_directory(path: str) -> str:
    """A training workdir's checkpoints/ directory, or `path` itself (as `zeroflax generate` takes it)."""
    inner = os.path.join(path, "checkpoints")
    return inner if os.path.isdir(inner) else path


def gpt_abstract_params(model_config):
    """(abstract params, logical names) of the GPT of `model_config`, without allocating it."""
    import jax

    from zeroflax.adapters import unbox
    from zeroflax.models.gpt import GPT
    model = GPT(model_config)
    return unbox(jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, model_config.max_len), "int32"))["params"]))


def export_safetensors(checkpoint_dir: str, out_path: str, *, step: int | None = None,
                       dtype: str | None = None) -> dict:
    """Write the consolidated parameters of a checkpoint (any ZeRO stage, any mesh) to `out_path`.

    checkpoint_dir: a training workdir or its checkpoints/ directory; step: default the newest complete one;
    dtype: None or 'fp32' keeps fp32, 'bf16' / 'fp16' cast the floating leaves (round to nearest even).
    Returns {'path', 'step', 'dtype', 'tensors': {name: (shape, dtype)}, 'bytes' (tensor data)}.
    """
    import jax
    from safetensors.numpy import save_file

    from zeroflax.version import __version__
    from zeroflax.checkpoint import CheckpointError, read_meta, restore_params
    from zeroflax.models.gpt import GPTConfig

    cast = _numpy_dtype(dtype)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ConfigError("--out", f"directory {out_dir} does not exist")
    directory = checkpoint_directory(checkpoint_dir)
    step, meta = read_meta(directory, step)
    if not isinstance(meta, dict) or "model" not in meta:
        raise CheckpointError(f"the checkpoint of step {step} in {directory} has no model config in its metadata "
                              "(written by zeroflax train, or with meta={'model': GPTConfig.to_dict()})")
    model_config = GPTConfig.from_dict(meta["model"])
    abstract, names = gpt_abstract_params(model_config)
    params = restore_params(directory, abstract, jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]), step)
    params = jax.device_get(params)
    stacked = stacked_paths(abstract, names)
    tensors = to_tensors(params, stacked)
    if cast is not None:
        tensors = {k: v.astype(cast) if _floating(v.dtype) else v for k, v in tensors.items()}
    metadata = {"zeroflax.model": json.dumps(meta["model"]), "zeroflax.step": str(step),
                "zeroflax.version": __version__, "zeroflax.naming": NAMING,
                "zeroflax.stacked": json.dumps(stacked), "zeroflax.dtype": dtype or "fp32"}
    save_file(tensors, out_path, metadata=metadata)
    return {"path": out_path, "step": step, "dtype": dtype or "fp32",
            "tensors": {k: (tuple(v.shape), str(v.dtype)) for k, v in sorted(tensors.items())},
            "bytes": int(sum(v.nbytes for v in tensors.values()))}


def check_safetensors(path: str, key: str) -> None:
    """A ConfigError naming `key` unless `path` is a readable safetensors file (its header only)."""
    from safetensors import safe_open

    from zeroflax.config import ConfigError
    try:
        with safe_open(path, framework="np") as f:
            f.keys()
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise ConfigError(key, f"{path} is not a readable safetensors file ({type(error).__name__}: {error})",
                          "give a file written by zeroflax export") from error


def load_safetensors(path: str, abstract_params: Any, *, stacked=None, cast: bool = False):
    """The parameter tree (host numpy arrays, the structure of `abstract_params`) of a file written by
    `export_safetensors`, its per-layer tensors stacked again.

    Every name, shape and dtype is checked against `abstract_params` (arrays or ShapeDtypeStructs); a missing,
    extra or mismatched tensor raises CheckpointError naming it. stacked: the stacked leaf paths (default: the
    file's `zeroflax.stacked` metadata, none if absent). cast: accept another floating dtype and convert it
    to the abstract leaf's (e.g. a bf16 export into fp32 parameters: exact); otherwise a dtype mismatch is an error.
    """
    import jax
    from safetensors import safe_open

    from zeroflax.checkpoint import CheckpointError  # here: `zeroflax --help` need not import orbax

    if not os.path.isfile(path):
        raise CheckpointError(f"safetensors file {path} does not exist")
    try:
        with safe_open(path, framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(error).__name__}: {error})") from error
    if stacked is None:
        stacked = json.loads(metadata.get("zeroflax.stacked", "[]"))
    stacked = set(stacked)
    paths, leaves = leaf_paths(abstract_params), jax.tree.leaves(abstract_params)
    unknown = stacked - set(paths)
    if unknown:
        raise CheckpointError(f"{path}: stacked parameter {sorted(unknown)[0]!r} is not in the model's parameters")

    used, out = set(), []

    def take(name, shape, dtype):
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} is missing (the model expects shape {tuple(shape)})")
        value = tensors[name]
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(value.shape)}, the model expects "
                                  f"{tuple(shape)}")
        if value.dtype != dtype:
            floating = _floating(value.dtype) and _floating(dtype)
            if not (cast and floating):
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {value.dtype}, the model expects {dtype}"
                                      + (" (load with cast=True to convert)" if floating else ""))
            value = value.astype(dtype)
        used.add(name)
        return value

    for p, leaf in zip(paths, leaves):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if p in stacked:
            if not shape:
                raise CheckpointError(f"{path}: stacked parameter {p!r} is a scalar in the model")
            out.append(np.stack([take(f"{LAYER_PREFIX}.{i}.{p}", shape[1:], dtype) for i in range(shape[0])]))
        else:
            out.append(take(p, shape, dtype))
    extra = sorted(set(tensors) - used)
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]!r} is not a parameter of the model"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_params), out)


def initialize_from_safetensors(engine, state, path: str, *, stacked=None):
    """`state` (fresh from `zeroflax.initialize`) with its parameters from `path`, placed with the engine's
    shardings (in its storage order, with the offload compute copy remade); the rest of the state is kept.
    A bf16/fp16 export is accepted and widened to the master dtype (exact)."""
    import jax
    from zeroflax.sharding.padding import stored_shape
    model_params = engine.model_params(state)
    params = load_safetensors(path, model_params, stacked=stacked, cast=True)
    # make_array_from_callback: each process places only the shards its devices hold (multi-process safe),
    # of the leaf as the engine stores it (zero-padded where partitioned unevenly: sharding.padding).
    def place(a, sharding):
        stored = stored_shape(a.shape, sharding)
        if stored != tuple(a.shape):
            a = np.pad(a, [(0, n - m) for m, n in zip(a.shape, stored)])
        return jax.make_array_from_callback(stored, sharding, lambda index: a[index])
    placed = jax.tree.map(place, params, engine.state_shardings.params)
    return engine.storage_order(engine.model_order(state).replace(params=placed, compute_params=None))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's parameters to a safetensors file (one CPU device)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a training workdir or its checkpoints/ directory")
    p.add_argument("--format", default="safetensors", help="the file format: safetensors (the only one)")
    p.add_argument("--dtype", default=None, help="fp32 (default, as stored), bf16 or fp16: casts the floating tensors")
    p.add_argument("--out", default=None,
                   help="output file (default: model_step{N}.safetensors beside the checkpoints/ directory)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.set_defaults(run=cmd_export)


def cmd_export(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.format != "safetensors":
        raise ConfigError("--format", f"unknown format {args.format!r}", "use safetensors")
    _numpy_dtype(args.dtype)  # a bad --dtype fails before anything is read
    out = args.out
    if out is None:
        from zeroflax.checkpoint import read_meta
        directory = checkpoint_directory(args.checkpoint)
        step, _ = read_meta(directory, args.step)
        out = os.path.join(os.path.dirname(os.path.abspath(directory)), f"model_step{step}.safetensors")
    summary = export_safetensors(args.checkpoint, out, step=args.step, dtype=args.dtype)
    tensors = summary["tensors"]
    count = sum(int(np.prod(shape)) for shape, _ in tensors.values())
    layers = {name.split(".")[1] for name in tensors if name.startswith(LAYER_PREFIX + ".")}
    print(f"wrote {summary['path']}: {len(tensors)} tensors, {count:,} parameters, {summary['bytes']:,} bytes "
          f"({summary['dtype']}) from the checkpoint of step {summary['step']}; stacked layers written one tensor "
          f"per layer ({len(layers)} layers, names 'layers.<i>.<name>'), the model config in the file's metadata. "
          "Load with safetensors.numpy.load_file or safetensors.torch.load_file.")
    return 0
