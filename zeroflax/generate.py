"""Sampling text from a trained byte-level GPT, on whatever single device is at hand."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.models.gpt import GPT, GPTConfig


@functools.partial(jax.jit, static_argnames=("model_config", "length", "temperature"))
def _sample(params, window, start, rng, *, model_config: GPTConfig, length: int, temperature: float):
    """Append `length` tokens to `window[:start]`; the context slides when the window is full."""
    max_len = window.shape[0]
    model = GPT(model_config, remat="none")

    def one(i, carry):
        window, position, rng = carry
        rng, key = jax.random.split(rng)
        logits = model.apply({"params": params}, window[None])[0].astype(jnp.float32)
        last = jnp.minimum(position, max_len) - 1
        next_logits = logits[last]
        if temperature > 0:
            token = jax.random.categorical(key, next_logits / temperature)
        else:
            token = jnp.argmax(next_logits)
        full = position >= max_len
        window = jnp.where(full, jnp.roll(window, -1).at[-1].set(token), window.at[position].set(token))
        return window, position + 1, rng

    def collect(i, carry):
        window, position, rng, out = carry
        window, position, rng = one(i, (window, position, rng))
        out = out.at[i].set(window[jnp.minimum(position, max_len) - 1])
        return window, position, rng, out

    out = jnp.zeros((length,), window.dtype)
    *_, out = jax.lax.fori_loop(0, length, collect, (window, start, rng, out))
    return out


def generate_text(model_config: GPTConfig, params, prompt: str, length: int = 200, temperature: float = 0.8,
                  seed: int = 0) -> str:
    """The prompt followed by `length` sampled bytes, decoded as UTF-8 (invalid bytes replaced)."""
    prompt_bytes = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32)
    if prompt_bytes.size == 0:
        prompt_bytes = np.frombuffer(b"\n", np.uint8).astype(np.int32)
    prompt_bytes = prompt_bytes[-model_config.max_len:]
    window = np.zeros((model_config.max_len,), np.int32)
    window[:prompt_bytes.size] = prompt_bytes
    out = _sample(params, jnp.asarray(window), jnp.asarray(prompt_bytes.size), jax.random.PRNGKey(seed),
                  model_config=model_config, length=length, temperature=float(temperature))
    generated = bytes(np.asarray(out, np.uint8).tolist())
    return prompt + generated.decode("utf-8", errors="replace")
