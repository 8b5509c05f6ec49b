"""The real DeepSpeed configs of tests/data/deepspeed_corpus/ (copied unchanged; SOURCES.tsv says from where)
through from_deepspeed, three ways, and the outcome of each recorded in
tests/data/deepspeed_corpus_outcomes.json:

  as_written  from_deepspeed(path, world_size=8): nothing but the JSON and the cluster size;
  hugging_face  with the values Hugging Face's Trainer would supply (HF below: bf16, micro-batch 8, lr 5e-5,
              a 100-step warm-up of 1000 steps, clipping 1.0, hidden size 4096);
  cli         the CLI's path, `zeroflax train --deepspeed_config` without gin bindings (deepspeed_job with
              TrainConfig() and Config(), 8 devices).

An outcome is "imports" or the one-line ConfigError (its JSON path first). tests/test_deepspeed_corpus.py holds
every file to its recorded outcome; `python tests/deepspeed_corpus.py` prints the shares and the refusals
grouped by key, and `--write` records the outcomes anew (after a change that is meant to change them).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import io
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "data", "deepspeed_corpus")
OUTCOMES = os.path.join(HERE, "data", "deepspeed_corpus_outcomes.json")
WORLD = 8
HF = dict(learning_rate=5e-5, warmup_steps=100, total_steps=1000, hidden_size=4096)
WAYS = ("as_written", "hugging_face", "cli")


def sources() -> list[dict]:
    with open(os.path.join(CORPUS, "SOURCES.tsv")) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def outcome(path: str, way: str) -> str:
    """'imports', or the ConfigError's one line. Anything else (a traceback) propagates."""
    import zeroflax
    from zeroflax.deepspeed_config import from_deepspeed
    from zeroflax.models.gpt import GPTConfig
    from zeroflax.train import TrainConfig, deepspeed_job
    try:
        if way == "as_written":
            from_deepspeed(path, world_size=WORLD)
        elif way == "hugging_face":
            base = zeroflax.Config(precision="bf16", micro_batch_size=8, grad_clip=1.0)
            from_deepspeed(path, world_size=WORLD, base=base, **HF)
        else:  # the data axis spans the 8 devices (the suite's, or this script's simulated ones)
            with contextlib.redirect_stdout(io.StringIO()):  # it prints its notes, as the CLI does
                deepspeed_job(path, TrainConfig(), zeroflax.Config(), GPTConfig(), bound={})
    except zeroflax.ConfigError as error:
        return str(error)
    return "imports"


def run() -> dict[str, dict[str, str]]:
    return {row["file"]: {way: outcome(os.path.join(CORPUS, row["file"]), way) for way in WAYS} for row in sources()}


def summary(outcomes: dict[str, dict[str, str]]) -> str:
    n = len(outcomes)
    lines = [f"{n} configs ({WORLD} data-parallel devices)"]
    for way in WAYS:
        ok = sum(o[way] == "imports" for o in outcomes.values())
        lines.append(f"  {way}: {ok} of {n} import ({100 * ok / n:.0f}%)")
    groups = collections.Counter(o["as_written"].split(": ", 1)[0] for o in outcomes.values() if o["as_written"] != "imports")
    lines.append("refusals as written, by key:")
    lines += [f"  {count:3d}  {key}" for key, count in groups.most_common()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the outcomes in " + OUTCOMES)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={WORLD}"
    outcomes = run()
    print(summary(outcomes))
    if args.write:
        with open(OUTCOMES, "w") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {OUTCOMES}")


if __name__ == "__main__":
    main()
