"""`python -m engine train --moe N --top-k K`: the demo GPT with MoE MLPs (engine.moe.MoEMLP), end to end on a tiny
model; the dense default unchanged; the MoE shape kept in the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.cli import main
from engine.train.model import GPT, VOCAB_SIZE, GPTConfig, MoEFeedForward

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--eval-every", "3", "--in-process", "--no-progress", "--speed-rounds", "0"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_run")
    assert main(["train", "--moe", "4", "--top-k", "2", "--steps", "6", "--recipes", "bf16,mxfp8", "--out", str(out),
                 *TINY]) == 0
    return out


def test_moe_runs_train_and_write_the_table_files(moe_run):
    results = json.loads((moe_run / "results.json").read_text())
    assert [r["recipe"] for r in results] == ["bf16", "mxfp8"]
    for r in results:
        assert len(r["train_losses"]) == 6 and r["tokens_per_second"] > 0
        assert r["train_losses"][-1] < r["train_losses"][0]
    checkpoint = torch.load(moe_run / "mxfp8.pt", weights_only=True)
    assert checkpoint["model_config"]["moe_experts"] == 4 and checkpoint["model_config"]["moe_top_k"] == 2
    assert sum(k.startswith("blocks.0.mlp.moe.fc1.weight") for k in checkpoint["model"]) == 4
    assert (moe_run / "losses.png").is_file()


def test_a_resumed_moe_run_keeps_its_experts(moe_run, tmp_path):
    with pytest.raises(SystemExit, match="--moe 8: .* holds a model with --moe 4"):
        main(["train", "--resume", str(moe_run / "bf16.pt"), "--recipe", "bf16", "--moe", "8", "--steps", "1",
              "--out", str(tmp_path), *TINY])


def test_the_loss_adds_the_load_balancing_losses_and_dense_stays_the_default() -> None:
    assert GPTConfig().moe_experts == 0 and isinstance(GPT(GPTConfig(n_layers=1)).blocks[0].mlp, engine.LayerNormMLP)
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, moe_experts=4, moe_top_k=2))
    tokens = torch.randint(0, VOCAB_SIZE, (2, 17))
    loss = model.loss(tokens)
    cross_entropy = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
    aux = [b.mlp.moe.aux_loss for b in model.blocks]
    assert all(isinstance(b.mlp, MoEFeedForward) for b in model.blocks) and all(a > 0 for a in aux)
    torch.testing.assert_close(loss, cross_entropy + aux[0] + aux[1])


def test_top_k_above_the_experts_is_refused_naming_the_flags(tmp_path):
    with pytest.raises(SystemExit, match="--top-k, --moe: moe_top_k \\(5\\) must be at most moe_experts \\(4\\)"):
        main(["train", "--moe", "4", "--top-k", "5", "--steps", "1", "--out", str(tmp_path), *TINY])


def test_tensor_parallel_is_refused_with_moe(tmp_path):
    with pytest.raises(SystemExit, match="--tp 2: not with --moe"):
        main(["train", "--moe", "4", "--nproc", "2", "--tp", "2", "--steps", "1", "--out", str(tmp_path), *TINY])


def test_generate_runs_an_moe_checkpoint_cast_to_bf16_and_quantized(moe_run):
    """`engine generate` casts the blocks to bf16 and quantize_s every linear layer, the router included."""
    assert main(["generate", "--checkpoint", str(moe_run / "mxfp8.pt"), "--quantize", "bf16,int8wo",
                 "--max-new-tokens", "2", "--repeats", "1", "--prompt", "def "]) == 0
