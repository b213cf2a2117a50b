"""The demo GPT's KV cache and `python -m engine generate`: cached decoding computes what recomputing the whole
sequence computes (bf16 and quantized), the command prints text, speeds and a table, bad arguments are named."""

from __future__ import annotations

import pytest
import torch

from engine.cli import main
from engine.train.generate import encode, generate, load_model
from engine.train.model import GPT, GPTConfig, KVCache

TEXT = "def double(x):\n    return 2 * x  # twice\n"


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory) -> str:
    """A tiny demo GPT trained for a few steps on one repeated function (seconds)."""
    torch.manual_seed(0)
    config = GPTConfig(d_model=64, n_layers=2, n_heads=2, seq_len=48)
    model = GPT(config)
    data = torch.frombuffer(bytearray((TEXT * 40).encode()), dtype=torch.uint8).long()
    tokens = torch.stack([data[i * 7: i * 7 + 49] for i in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(50):  # loss ~0.07: the function is learned
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("gen") / "bf16.pt"
    torch.save({"model": model.state_dict(), "model_config": config.model_dump(), "seed": 0}, path)
    return str(path)


def checkpoint(path: str) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", ["bf16", "int8wo", "int4wo-g32"])
def test_cached_logits_equal_the_full_forward(checkpoint_path: str, name: str) -> None:
    """Prefill 5 positions, a chunk of 3 (a causal mask offset by the cache), then one at a time: each step's
    logits are the full forward's at those positions, up to bf16 rounding (other GEMM shapes, other kernels)."""
    model = load_model(checkpoint(checkpoint_path), name)
    tokens = encode(TEXT[:14])
    with torch.inference_mode():
        full = model(tokens)
        cache = KVCache(model.cfg)
        steps = [model(tokens[:, :5], cache), model(tokens[:, 5:8], cache)]
        steps += [model(tokens[:, i:i + 1], cache) for i in range(8, 14)]
    assert cache.length == 14
    cached = torch.cat(steps, dim=1)
    assert (cached - full).abs().max() < 0.05 * full.abs().max()


@pytest.mark.parametrize("name", ["bf16", "int8dq"])
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (0.9, 8)])
def test_cached_generation_equals_recomputing(checkpoint_path: str, name: str, temperature: float, top_k: int) -> None:
    model = load_model(checkpoint(checkpoint_path), name)
    prompt = encode("def double(x")
    cached = generate(model, prompt, 30, temperature=temperature, top_k=top_k, seed=3)
    recomputed = generate(model, prompt, 30, temperature=temperature, top_k=top_k, seed=3, use_cache=False)
    assert len(cached.tokens) == 30 and cached.tokens == recomputed.tokens
    if temperature == 0:  # the trained function comes back
        assert bytes(cached.tokens).decode().startswith("):\n    return 2 * x")
    else:
        assert generate(model, prompt, 30, temperature=temperature, top_k=top_k, seed=3).tokens == cached.tokens


def test_positions_past_seq_len_are_refused(checkpoint_path: str) -> None:
    model = load_model(checkpoint(checkpoint_path), "bf16")
    cache = KVCache(model.cfg)
    with torch.inference_mode():
        model(torch.zeros(1, 40, dtype=torch.long), cache)
        with pytest.raises(ValueError, match=r"tokens: positions 40\.\.49 go past the last learned position 47 "
                                             r"\(seq_len 48; no sliding window\)"):
            model(torch.zeros(1, 10, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="positions 0..48"):
            model(torch.zeros(1, 49, dtype=torch.long))


def test_the_command_prints_text_and_speeds(checkpoint_path: str, capsys) -> None:
    assert main(["generate", "--checkpoint", checkpoint_path, "--prompt", "def double(x",
                 "--max-new-tokens", "14", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "def double(x):\n    return" in out and "prefill" in out and "decode" in out and "tokens/s" in out
    assert main(["generate", "--checkpoint", checkpoint_path, "--quantize", "int8wo,int4wo-g32", "--prompt", "def ",
                 "--max-new-tokens", "8", "--repeats", "2", "--temperature", "0.7", "--top-k", "5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["config", "bf16", "int8wo", "int4wo-g32"]
    assert rows[1].split("|")[3].strip() == "1.00x"


@pytest.mark.parametrize("argv,message", [
    (["--quantize", "int3"], "engine generate: error: argument --quantize: expected all, or a comma-separated list"),
    (["--max-new-tokens", "0"], "engine generate: error: argument --max-new-tokens: expected an integer >= 1"),
    (["--temperature", "-1"], "engine generate: error: argument --temperature: expected a finite number >= 0"),
    (["--top-k", "5"], "engine generate: --top-k: only with --temperature > 0"),
    (["--threads", "x"], "engine generate: error: argument --threads: expected an integer >= 1, got 'x'"),
    (["--max-new-tokens", "48"], "engine generate: --max-new-tokens: the prompt (4 bytes) and 48 new tokens need 51 "
                                 "positions; the model learned 48"),
    (["--prompt", ""], "engine generate: --prompt: expected at least one byte"),
])
def test_bad_arguments_are_named(checkpoint_path: str, argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--checkpoint", checkpoint_path, *argv])
    assert message in (str(info.value.code) if isinstance(info.value.code, str) else capsys.readouterr().err)


def test_a_file_that_is_no_training_checkpoint(tmp_path) -> None:
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="engine generate: --checkpoint: .*other.pt is not a checkpoint"):
        main(["generate", "--checkpoint", str(tmp_path / "other.pt")])
    with pytest.raises(SystemExit, match="engine generate: --checkpoint: cannot load"):
        main(["generate", "--checkpoint", str(tmp_path / "missing.pt")])
