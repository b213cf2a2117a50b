"""`train --resume CKPT` takes the model's shape from the checkpoint (its `model_config`): the resume hint a run
prints works as printed, for any size; flags that contradict the checkpoint, and old checkpoints without the
config, get a message that names the flags."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from engine.cli import main

SIZE = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "ffn_mult": 4,  # the shape flags: not defaults
        "moe_experts": 0, "moe_top_k": 2}  # dense (the MoE fields, saved since --moe)
FLAGS = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16"]
QUICK = ["--batch-size", "4", "--eval-every", "10", "--no-progress"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A 2-step delayed-scaling run of a non-default size, and the resume hint it printed."""
    out = tmp_path_factory.mktemp("small")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", "--recipes", "delayed", "--steps", "2", "--seed", "3", "--out", str(out),
                     "--in-process", *FLAGS, *QUICK]) == 0
    return out, re.search(r"resume with --resume (\S+) --recipe <name>", printed.getvalue()).group(1)


def test_the_printed_resume_hint_works_without_repeating_the_size(small_run, tmp_path, capfd):
    """As printed (no --in-process: the run trains in a fresh process, where it used to fail with a traceback)."""
    out, checkpoint = small_run
    assert torch.load(checkpoint, weights_only=True)["model_config"] == SIZE  # plain data, saved with the weights
    assert main(["train", "--resume", checkpoint, "--recipe", "current", "--steps", "1", "--out", str(tmp_path),
                 *QUICK]) == 0
    assert f"model: {SIZE}" in capfd.readouterr().out
    (result,) = json.loads((tmp_path / "results.json").read_text())
    assert result["steps"] == [3, 3]
    resumed = torch.load(tmp_path / "current.pt", weights_only=True)
    assert resumed["model_config"] == SIZE and resumed["step"] == 3
    assert resumed["seed"] == 3  # the checkpoint's data order, not the default seed 0


def test_flags_may_repeat_the_checkpoints_shape(small_run, tmp_path):
    _, checkpoint = small_run
    assert main(["train", "--resume", checkpoint, "--recipe", "delayed", "--steps", "1", "--out", str(tmp_path),
                 "--in-process", *FLAGS, *QUICK]) == 0


@pytest.mark.parametrize("flag, value, kept", [("--d-model", "64", "32"), ("--layers", "4", "1"),
                                               ("--heads", "4", "2"), ("--seq-len", "128", "16")])
def test_a_flag_that_contradicts_the_checkpoint_is_refused(small_run, tmp_path, flag, value, kept):
    _, checkpoint = small_run
    with pytest.raises(SystemExit) as raised:
        main(["train", "--resume", checkpoint, "--recipe", "delayed", flag, value, "--steps", "1",
              "--out", str(tmp_path), "--in-process", *QUICK])
    assert str(raised.value) == (f"engine train: {flag} {value}: {checkpoint} holds a model with {flag} {kept}, and "
                                 f"a resumed run keeps the checkpoint's model; leave {flag} out (or pass {kept})")


def test_an_old_checkpoint_without_the_config_names_the_flags_to_pass(small_run, tmp_path):
    _, checkpoint = small_run
    old = torch.load(checkpoint, weights_only=True)
    del old["model_config"]
    torch.save(old, tmp_path / "old.pt")
    base = ["train", "--resume", str(tmp_path / "old.pt"), "--recipe", "delayed", "--steps", "1", "--in-process",
            "--out", str(tmp_path / "out"), *QUICK]
    with pytest.raises(SystemExit) as raised:
        main([*base, "--d-model", "32"])
    assert str(raised.value) == (f"engine train: --resume: {tmp_path / 'old.pt'} holds no model_config (a checkpoint "
                                 "of an older engine train): pass the run's --layers, --heads, --seq-len (its model's "
                                 "shape)")
    with pytest.raises(SystemExit, match=r"pos_emb.weight: expected shape \(32, 32\) for --seq-len 32 --d-model 32, "
                                         r"got \(16, 32\)"):
        main([*base, "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32"])
    with pytest.raises(SystemExit, match="the model has 1 blocks, not --layers 2"):
        main([*base, "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16"])
    assert main([*base, *FLAGS]) == 0
    assert torch.load(tmp_path / "out" / "delayed.pt", weights_only=True)["model_config"] == SIZE


@pytest.mark.parametrize("content, message", [
    (None, "no checkpoint at"),
    (b"not a checkpoint", "cannot load"),
    ({"model": {}}, "is not a checkpoint of `python -m engine train` (no 'optimizer' key)"),
])
def test_a_file_that_is_no_run_checkpoint(tmp_path, content, message):
    path = tmp_path / "x.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(SystemExit) as raised:
        main(["train", "--resume", str(path), "--recipe", "bf16", "--steps", "1", "--out", str(tmp_path),
              "--in-process"])
    assert str(raised.value).startswith("engine train: --resume: ") and message in str(raised.value)
