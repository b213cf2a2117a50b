"""python -m engine eval: one table of validation loss and perplexity per inference config vs bf16."""

from __future__ import annotations

import math

import torch

from engine.cli import main
from engine.train.eval import evaluate_checkpoint
from engine.train.data import load_corpus
from engine.train.model import GPT, GPTConfig


def test_eval_prints_one_row_per_config(tmp_path, capsys) -> None:
    corpus_path = tmp_path / "corpus.txt"
    corpus_path.write_text("def double(x):\n    return 2 * x  # twice\n" * 400)
    torch.manual_seed(0)
    config = GPTConfig(d_model=64, n_layers=1, n_heads=2, seq_len=32)
    model = GPT(config)
    tokens = torch.frombuffer(bytearray(corpus_path.read_bytes()[:33 * 8]), dtype=torch.uint8).long().view(8, 33)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(5):  # a little training: losses well below ln(256)
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    checkpoint = {"model": model.state_dict(), "model_config": config.model_dump(), "seed": 0}
    torch.save(checkpoint, tmp_path / "bf16.pt")
    assert main(["eval", str(tmp_path / "bf16.pt"), "--configs", "int8wo,int4wo-g32", "--data", str(corpus_path),
                 "--eval-batches", "2", "--batch-size", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in lines] == ["config", "bf16", "int8wo", "int4wo-g32"]
    rows = evaluate_checkpoint(checkpoint, load_corpus(str(corpus_path)), ["int8wo"], eval_batches=2, batch_size=2)
    base, int8 = rows
    assert base["val_loss"] < math.log(256) - 0.5
    assert math.isclose(base["perplexity"], math.exp(base["val_loss"]))
    assert abs(int8["val_loss"] - base["val_loss"]) < 0.02 * base["val_loss"]
    assert int8["linear_weight_bytes"] < base["linear_weight_bytes"] * 0.6
