"""Real DeepSpeed configs from 20 public repositories (tests/data/deepspeed_corpus/, copied unchanged with
their licenses; SOURCES.tsv: repository, commit, path) each import or give their one recorded refusal line,
as written, with Hugging Face's values and through the CLI's path (tests/deepspeed_corpus.py; the recorded
outcomes are tests/data/deepspeed_corpus_outcomes.json, and docs/from_deepspeed.md says why each group of
refusals is right)."""
import json
import os

import pytest

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
