"""Every gin file in experiments/ parses and builds valid configs (the CLI's first step)."""
import glob
import os

import gin
import pytest

from zeroflax.config import Config
from zeroflax.models.gpt import GPTConfig
from zeroflax.train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN_FILES = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.gin")))


def test_there_are_experiments():
    assert len(GIN_FILES) >= 7


@pytest.mark.parametrize("path", GIN_FILES, ids=os.path.basename)
def test_gin_file_builds_valid_configs(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # includes are relative to the repository root, as the README runs them
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings([path], [])
        config, model, train = Config(), GPTConfig(), TrainConfig()
    finally:
        gin.clear_config()
    name = os.path.basename(path)
    if "zero" in name:
        assert config.zero_stage == int(name.split("zero")[1][0])
    for precision in ("bf16", "fp16"):
        if precision in name:
            assert config.precision == precision
    if "qwz" in name:
        assert config.quantized_weights and config.zero_stage == 3 and config.precision == "bf16"
    if "offload" in name:
        assert config.offload_optimizer.enabled and config.offload_param.enabled and config.zero_stage == 3
    if "onebit" in name:  # 1-bit Adam refuses stage 3; its warm-up is 15% of the run
        assert train.optimizer == "onebit_adam" and config.zero_stage == 2 and train.freeze_step == round(0.15 * train.steps)
    if "sparse" in name:
        assert model.attention == "sparse" and model.sparsity.num_heads == model.num_heads
        model.sparsity.make_layout(train.seq_len)
    assert model.max_len >= train.seq_len
    assert train.workdir.startswith("runs/")
