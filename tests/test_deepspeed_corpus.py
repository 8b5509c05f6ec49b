"""Real DeepSpeed configs from 20 public repositories (tests/data/deepspeed_corpus/, copied unchanged with
their licenses; SOURCES.tsv: repository, commit, path) each import or give their one recorded refusal line,
as written, with Hugging Face's values and through the CLI's path (tests/deepspeed_corpus.py; the recorded
outcomes are tests/data/deepspeed_corpus_outcomes.json, and docs/from_deepspeed.md says why each group of
refusals is right)."""
import copy
import json
import os

import numpy as np
import pytest

from zeroflax import ConfigError
from zeroflax.deepspeed_config import from_deepspeed

from deepspeed_corpus import CORPUS, OUTCOMES, WAYS, outcome, sources

with open(OUTCOMES) as f:
    RECORDED = json.load(f)
ROWS = sources()


def test_every_config_has_a_source_a_license_and_a_recorded_outcome():
    assert len(ROWS) >= 60 and sorted(r["file"] for r in ROWS) == sorted(RECORDED)
    for row in ROWS:
        assert len(row["commit"]) == 40 and row["path"].endswith((".json", ".conf")), row
        folder = os.path.join(CORPUS, os.path.dirname(row["file"]))
        assert any(name.upper().startswith(("LICENSE", "COPYING")) for name in os.listdir(folder)), folder


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_config_imports_or_gives_its_recorded_refusal(name):
    path = os.path.join(CORPUS, name)
    for way in WAYS:
        got = outcome(path, way)  # a traceback fails the test
        assert "\n" not in got, got
        assert got == RECORDED[name][way], f"{way}: {got}"


def test_damaged_configs_give_one_line_errors_never_a_traceback():
    """2,000 variants of the corpus (seeded): one key of a real file set to a value of another kind ("auto",
    null, a list, an object, a string, a negative, a huge number, true, 0, 2.5). Each imports or raises a
    one-line ConfigError; any other exception fails the test with the variant that raised it."""
    rng = np.random.default_rng(0)
    values = ["auto", None, [], {}, "x", -1, 1e30, True, 0, 2.5]

    def paths(tree, prefix=()):
        for key, value in tree.items():
            yield prefix + (key,)
            if isinstance(value, dict):
                yield from paths(value, prefix + (key,))

    for _ in range(2000):
        row = ROWS[rng.integers(len(ROWS))]
        with open(os.path.join(CORPUS, row["file"])) as f:
            ds = json.load(f)
        where = list(paths(ds))
        path, value = where[rng.integers(len(where))], values[rng.integers(len(values))]
        damaged = copy.deepcopy(ds)
        block = damaged
        for key in path[:-1]:
            block = block[key]
        block[path[-1]] = value
        try:
            from_deepspeed(damaged, world_size=8, total_steps=100)
        except ConfigError as error:
            assert "\n" not in str(error), str(error)
        except Exception as error:  # noqa: BLE001 - the point: nothing but a ConfigError
            pytest.fail(f"{row['file']}: {'.'.join(map(str, path))} = {value!r}: {type(error).__name__}: {error}")
