"""Data for byte-level language-model training: token sources (including a built-in offline English corpus)
and deterministic, resumable, process-sharded batch loaders. numpy only, so it never initialises jax itself."""
from zeroflax.data.corpus import DataError, builtin_corpus, load_text_file, load_token_file, load_tokens
from zeroflax.data.loader import TokenLoader, num_windows, train_val_split, validation_batches

__all__ = [
    "DataError", "TokenLoader", "builtin_corpus", "load_text_file", "load_token_file", "load_tokens",
    "num_windows", "train_val_split", "validation_batches",
]
