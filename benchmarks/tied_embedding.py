"""A tied token embedding at ZeRO-3 (issue 42): where it is gathered and what that costs per device.

transformers' FlaxGPT2LMHeadModel (random init from a config, the installed package's own file), its LM
head tied to the token embedding through `wte.embedding.T`, with a vocabulary large enough for the
embedding to be the largest tensor, as in real language models. One compiled step on 8 simulated CPU
devices, bf16 compute, stage 3; compile-only, nothing is trained.

    python benchmarks/tied_embedding.py [--vocab 16384] [--json runs/tied_embedding.json]

Printed: the leaves gathered on entry, the gathered weights alive at the peak (the memory report's
schedule analysis) against the embedding's bytes and the two largest groups', XLA's temporaries, and the
collective bytes against ZeRO-3's theory. Run it at two commits to compare (before issue 42's
relocation the embedding is gathered on entry and kept for the whole step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import zeroflax  # noqa: E402

KiB = 2**10


def gpt2_case(vocab: int, width: int, layers: int, seq_len: int):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=width, n_layer=layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(config, seed=0, dtype=jnp.float32)
    module = model.module

    def loss(params, batch, rng):
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = module.apply({"params": params}, tokens, jnp.ones_like(tokens), positions,
                              deterministic=True)[0].astype(jnp.float32)
        logz = jax.nn.logsumexp(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logits[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)

    tokens = np.random.default_rng(0).integers(0, vocab, (16, seq_len)).astype(np.int32)
    return model.params, loss, {"tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    params, loss, batch = gpt2_case(args.vocab, args.width, args.layers, args.seq_len)
    config = zeroflax.Config(zero_stage=3, precision="bf16", micro_batch_size=2)
    engine, state = zeroflax.initialize(loss, params, optax.adamw(1e-3), config)
    comm = zeroflax.comm_report(engine, state, batch)
    memory = zeroflax.memory_report(engine, state, batch)
    embedding_bytes = 2 * args.vocab * args.width  # bf16, gathered whole
    largest = sorted(memory.groups.values(), reverse=True)[:2]
    figures = {
        "vocab": args.vocab, "width": args.width, "layers": args.layers,
        "gathered_on_entry": engine.gathered_on_entry_reasons(),
        "gathered_peak_bytes": memory.gathered_peak,
        "embedding_bytes": embedding_bytes,
        "two_largest_groups_bytes": 2 * sum(largest),
        "temp_bytes": memory.temp,
        "comm_ratio": comm.ratio,
        "groups": len(engine.trace.gather_usage.groups) if engine.trace.gather_usage else None,
    }
    print(f"GPT-2, vocabulary {args.vocab} x {args.width}, {args.layers} layers, stage 3 bf16, 8 devices")
    print(f"  gathered on entry: {figures['gathered_on_entry'] or 'nothing'}")
    print(f"  gathered weights at the peak: {memory.gathered_peak / KiB:.1f} KiB (the embedding alone: "
          f"{embedding_bytes / KiB:.1f} KiB; the two largest groups: {2 * sum(largest) / KiB:.1f} KiB)")
    print(f"  temporaries: {memory.temp / KiB:.1f} KiB; communication {comm.ratio:.3f}x ZeRO-3's theory")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, default=str)


if __name__ == "__main__":
    main()
