"""Real models from public codebases, used unchanged (tests/real_models/*/SOURCES), at tiny shapes.

Each case gives what a user of that codebase already has: the model's own `init` output (boxed with
logical axes where the model declares them), a loss written as that codebase's training loop writes it,
and a few fixed-seed batches. Dropout is off (deterministic), so each case can be compared with a plain
single-device optax loop. `case(name, seq_len=...)` changes the sequence length of the sequence models
(the recurrent-cell checks compare 12 and 48 steps).

Library versions: Flax's example files need only flax (linen), jax and numpy; the hf_* cases need
transformers 4.46.3 (the test extra). Measured with flax 0.12.8 on jax 0.10.2.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).parent / "real_models"
STEPS = 3
GLOBAL_BATCH = 16  # 8 simulated devices x 2: one micro-batch per device and step


@functools.cache
def flax_example(name: str):
    """`examples/<name>/models.py` of Flax's repository, imported from tests/real_models/flax_examples."""
    path = HERE / "flax_examples" / name / "models.py"
    spec = importlib.util.spec_from_file_location(f"flax_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Case:
    """One real model: `variables` as its `init` returns them, `loss(params, batch, rng[, state])`."""

    name: str
    variables: Any  # {'params': ..., other collections}
    loss: Callable
    batches: list
    model_state: tuple = ()  # collections kept as model state (BatchNorm's batch_stats)
    recurrent: bool = False  # a cell reused at every step of a scan (communication must not grow with length)

    @property
    def params(self):
        return self.variables["params"]

    def init_arg(self):
        """What `zeroflax.initialize` takes as parameters: the params alone, or the whole variables dict."""
        return self.variables if self.model_state else self.params


def _cross_entropy(logits, labels):
    logits = logits.astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))


def _tokens(rng, vocab, length, batch=GLOBAL_BATCH):
    return rng.integers(2, vocab, size=(batch, length)).astype(np.int32)


def lm1b(seq_len: int = 16) -> Case:
    """Flax's lm1b TransformerLM (decoder-only, logical axes on every parameter, nn.Embed)."""
    models = flax_example("lm1b")
    config = models.TransformerConfig(vocab_size=64, output_vocab_size=64, emb_dim=32, num_heads=4, num_layers=2,
                                      qkv_dim=32, mlp_dim=64, max_len=64, dropout_rate=0.0,
                                      attention_dropout_rate=0.0, deterministic=True)
    model = models.TransformerLM(config)
    rng = np.random.default_rng(0)
    batches = [{"tokens": _tokens(rng, 64, seq_len)} for _ in range(STEPS)]
    variables = model.init(jax.random.PRNGKey(0), batches[0]["tokens"][:1])

    def loss(params, batch, rng):
        logits = model.apply({"params": params}, batch["tokens"])
        return _cross_entropy(logits, batch["tokens"])

    return Case("lm1b", variables, loss, batches)


def wmt(seq_len: int = 12) -> Case:
    """Flax's wmt Transformer: encoder-decoder, one embedding shared by encoder, decoder and the logits
    (`share_embeddings`, `logits_via_embedding`: the head is `Embed.attend`)."""
    models = flax_example("wmt")
    config = models.TransformerConfig(vocab_size=48, output_vocab_size=48, share_embeddings=True,
                                      logits_via_embedding=True, emb_dim=32, num_heads=4, num_layers=2, qkv_dim=32,
                                      mlp_dim=64, max_len=64, dropout_rate=0.0, attention_dropout_rate=0.0,
                                      deterministic=True)
    model = models.Transformer(config)
    rng = np.random.default_rng(1)
    batches = [{"inputs": _tokens(rng, 48, seq_len), "targets": _tokens(rng, 48, seq_len)} for _ in range(STEPS)]
    variables = model.init(jax.random.PRNGKey(0), batches[0]["inputs"][:1], batches[0]["targets"][:1])

    def loss(params, batch, rng):
        logits = model.apply({"params": params}, batch["inputs"], batch["targets"])
        return _cross_entropy(logits, batch["targets"])

    return Case("wmt", variables, loss, batches)


def nlp_seq(seq_len: int = 12) -> Case:
    """Flax's nlp_seq Transformer encoder (part-of-speech tagging)."""
    models = flax_example("nlp_seq")
    config = models.TransformerConfig(vocab_size=40, output_vocab_size=10, emb_dim=32, num_heads=4, num_layers=2,
                                      qkv_dim=32, mlp_dim=64, max_len=64, dropout_rate=0.0,
                                      attention_dropout_rate=0.0)
    model = models.Transformer(config)
    rng = np.random.default_rng(2)
    batches = [{"tokens": _tokens(rng, 40, seq_len), "tags": _tokens(rng, 10, seq_len)} for _ in range(STEPS)]
    variables = model.init(jax.random.PRNGKey(0), inputs=batches[0]["tokens"][:1], train=False)

    def loss(params, batch, rng):
        logits = model.apply({"params": params}, inputs=batch["tokens"], train=False)
        return _cross_entropy(logits, batch["tags"])

    return Case("nlp_seq", variables, loss, batches)


def imagenet() -> Case:
    """Flax's imagenet ResNet (one stage of ResNet blocks) with its BatchNorm written for pmap
    (`axis_name='batch'`); the batch statistics are model state."""
    models = flax_example("imagenet")
    model = models.ResNet(stage_sizes=[1, 1], block_cls=models.ResNetBlock, num_classes=10, num_filters=8)
    rng = np.random.default_rng(3)
    batches = [{"image": rng.normal(size=(GLOBAL_BATCH, 16, 16, 3)).astype(np.float32),
                "label": rng.integers(0, 10, size=(GLOBAL_BATCH,)).astype(np.int32)} for _ in range(STEPS)]
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.PRNGKey(0), batches[0]["image"][:1])

    def loss(params, batch, rng, state):
        logits, new_state = model.apply({"params": params, **state}, batch["image"], mutable=list(state))
        return _cross_entropy(logits, batch["label"]), new_state

    return Case("imagenet", dict(variables), loss, batches, model_state=("batch_stats",))


def sst2(seq_len: int = 12) -> Case:
    """Flax's sst2 TextClassifier: submodules declared in setup(), a bidirectional LSTM (nn.scan over an
    OptimizedLSTMCell, reused at every step), attention pooling."""
    models = flax_example("sst2")
    model = models.TextClassifier(embedding_size=16, hidden_size=16, vocab_size=50, output_size=2,
                                  dropout_rate=0.0, word_dropout_rate=0.0, deterministic=True)
    rng = np.random.default_rng(4)
    batches = [{"tokens": _tokens(rng, 50, seq_len),
                "lengths": rng.integers(seq_len // 2, seq_len + 1, size=(GLOBAL_BATCH,)).astype(np.int32),
                "label": rng.integers(0, 2, size=(GLOBAL_BATCH,)).astype(np.int32)} for _ in range(STEPS)]
    variables = model.init(jax.random.PRNGKey(0), batches[0]["tokens"][:1], batches[0]["lengths"][:1])

    def loss(params, batch, rng):
        logits = model.apply({"params": params}, batch["tokens"], batch["lengths"])
        return _cross_entropy(logits, batch["label"])

    return Case("sst2", variables, loss, batches, recurrent=True)


def seq2seq(seq_len: int = 12) -> Case:
    """Flax's seq2seq: an LSTM encoder and a decoder cell (nn.RNN), both reused at every step."""
    models = flax_example("seq2seq")
    vocab = 12
    model = models.Seq2seq(teacher_force=True, hidden_size=16, vocab_size=vocab)
    rng = np.random.default_rng(5)

    batches = []
    for _ in range(STEPS):
        query = _tokens(rng, vocab, seq_len)
        query[:, -1] = 1  # eos_id: the encoder reads up to it
        batches.append({"query": query, "answer": _tokens(rng, vocab, seq_len + 1)})
    key = jax.random.PRNGKey(0)
    one_hot = lambda tokens: jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)
    variables = model.init({"params": key, "lstm": key}, one_hot(batches[0]["query"][:1]),
                           one_hot(batches[0]["answer"][:1]))

    def loss(params, batch, rng):
        # Token ids in the batch, one-hot here (fp32, as the decoder's own predictions are: the engine
        # casts float batches to the compute dtype, and the decoder's carry must keep one dtype).
        # The decoder samples a prediction with the 'lstm' stream; with teacher forcing the logits do not
        # depend on it, so a fixed key keeps the loss deterministic.
        logits, _ = model.apply({"params": params}, one_hot(batch["query"]), one_hot(batch["answer"]),
                                rngs={"lstm": jax.random.PRNGKey(1)})
        return _cross_entropy(logits, batch["answer"][:, 1:])

    return Case("seq2seq", variables, loss, batches, recurrent=True)


def hf_gpt2(seq_len: int = 12) -> Case:
    """transformers' FlaxGPT2LMHeadModel (the installed package's own file, transformers==4.46.3), random
    init from a config: its LM head is the token embedding, reached as `wte.embedding.T` in the model's
    code (a raw use of a parameter outside any module)."""
    from transformers import GPT2Config, FlaxGPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return _causal_lm("hf_gpt2", FlaxGPT2LMHeadModel(config, seed=0, dtype=jnp.float32), seq_len, seed=6)


def _causal_lm(name: str, model, seq_len: int, seed: int) -> Case:
    """A transformers causal LM (its module called as its own `__call__` calls it: ids, attention mask,
    positions) trained to predict its input tokens, on fixed-seed batches."""
    module = model.module
    rng = np.random.default_rng(seed)
    batches = [{"tokens": _tokens(rng, 64, seq_len)} for _ in range(STEPS)]

    def loss(params, batch, rng):
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = module.apply({"params": params}, tokens, jnp.ones_like(tokens), positions, deterministic=True)[0]
        return _cross_entropy(logits, tokens)

    return Case(name, {"params": model.params}, loss, batches)


def _clip_with_numpy_keywords():
    """transformers 4.46's Flax T5 calls `jnp.clip(x, a_max=...)`, numpy's keyword names, which jax 0.10
    removed (it takes `min`/`max`): `jnp.clip` is wrapped, for this process, to accept them too. The model's
    file stays as published; only the removed spelling is translated."""
    clip = jnp.clip
    if getattr(clip, "accepts_numpy_keywords", False):
        return

    @functools.wraps(clip)
    def accepting(x, min=None, max=None, *, a_min=None, a_max=None, **kwargs):
        return clip(x, a_min if min is None else min, a_max if max is None else max, **kwargs)

    accepting.accepts_numpy_keywords = True
    jnp.clip = accepting


def hf_t5(seq_len: int = 12) -> Case:
    """transformers' FlaxT5ForConditionalGeneration (transformers==4.46.3), random init from a config: the
    encoder, the decoder and the LM head share one embedding, the head reaching it as `shared.embedding.T`
    (a raw use outside any module); the decoder's input is the target shifted right, as T5's trainer does."""
    from transformers import FlaxT5ForConditionalGeneration, T5Config

    _clip_with_numpy_keywords()
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)
    model = FlaxT5ForConditionalGeneration(config, seed=0, dtype=jnp.float32)
    module = model.module
    rng = np.random.default_rng(7)
    batches = [{"inputs": _tokens(rng, 64, seq_len), "targets": _tokens(rng, 64, seq_len)} for _ in range(STEPS)]

    def loss(params, batch, rng):
        inputs, targets = batch["inputs"], batch["targets"]
        decoder_inputs = jnp.concatenate([jnp.zeros_like(targets[:, :1]), targets[:, :-1]], axis=1)
        logits = module.apply({"params": params}, inputs, jnp.ones_like(inputs), decoder_inputs,
                              jnp.ones_like(decoder_inputs), deterministic=True)[0]
        return _cross_entropy(logits, targets)

    return Case("hf_t5", {"params": model.params}, loss, batches)


def hf_bert(seq_len: int = 12) -> Case:
    """transformers' FlaxBertForMaskedLM (transformers==4.46.3), random init from a config: its decoder is the
    word embedding, reached as `word_embeddings.embedding.T` outside any module; the loss predicts every
    token (no masking: the test compares steps, not BERT's objective)."""
    from transformers import BertConfig, FlaxBertForMaskedLM

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = FlaxBertForMaskedLM(config, seed=0, dtype=jnp.float32)
    module = model.module
    rng = np.random.default_rng(8)
    batches = [{"tokens": _tokens(rng, 64, seq_len)} for _ in range(STEPS)]

    def loss(params, batch, rng):
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = module.apply({"params": params}, tokens, jnp.ones_like(tokens), jnp.zeros_like(tokens), positions,
                              None, deterministic=True)[0]
        return _cross_entropy(logits, tokens)

    return Case("hf_bert", {"params": model.params}, loss, batches)


def hf_llama(seq_len: int = 12) -> Case:
    """transformers' FlaxLlamaForCausalLM (transformers==4.46.3), random init from a config: rotary
    positions, RMSNorm, grouped-query attention (2 key-value heads for 4), an untied head."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return _causal_lm("hf_llama", FlaxLlamaForCausalLM(config, seed=0, dtype=jnp.float32), seq_len, seed=9)


# The cases whose model reuses one cell at every step of a scan, named here so that collecting the tests
# does not build every model.
RECURRENT = ("seq2seq", "sst2")
CASES = {"lm1b": lm1b, "wmt": wmt, "nlp_seq": nlp_seq, "imagenet": imagenet, "sst2": sst2, "seq2seq": seq2seq,
         "hf_gpt2": hf_gpt2, "hf_t5": hf_t5, "hf_bert": hf_bert, "hf_llama": hf_llama}
# The leaves each case's step gathers on entry, with a word of the reason the memory report gives: none
# since issue 42. A plain-array use outside any module (GPT-2's tied head) is gathered at each use, and a
# parameter shared by several groups within Config.max_reuse_distance (wmt's embedding: encoder,
# decoder, logits) at its first use, kept for the later ones (sharding/relocate.py).
ON_ENTRY: dict = {}


def case(name: str, **kwargs) -> Case:
    return CASES[name](**kwargs)
