"""The training examples run end to end at a toy size (so they do not rot): every run finishes,
writes its record, and the runs' loss curves agree, since they compute the same function."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("example,args,runs", [
    ("gpt2", ["--preset", "tiny", "--steps", "4", "--seqlen", "32", "--batch", "2"], ["sdpa", "default", "ours"]),
    ("gpt2", ["--preset", "tiny", "--steps", "4", "--seqlen", "32", "--batch", "2", "--repeat-reference"],
     ["sdpa", "sdpa_again", "default", "ours"]),
    ("gpt2", ["--preset", "tiny", "--steps", "4", "--seqlen", "32", "--batch", "2", "--repeat-reference", "--deterministic"],
     ["sdpa", "sdpa_again", "default", "ours"]),
    ("bert", ["--preset", "tiny", "--steps", "3", "--seqlen", "48", "--min-len", "8", "--batch", "3"], ["torch", "ours"]),
])
def test_example_runs(tmp_path, example, args, runs):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU size, wherever the suite runs
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", example, "train.py"), *args, "--out", str(tmp_path)],
                   check=True, env=env, stdout=subprocess.PIPE)
    (record,) = [json.load(open(tmp_path / f)) for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert [r["attention"] for r in record["results"]] == runs
    assert all(len(r["losses"]) == int(args[3]) for r in record["results"])
    assert record["max_rel_loss_diff"] < 1e-3
    if "--deterministic" in args:  # the reference reproduces itself exactly
        assert record["max_rel_loss_diffs"]["sdpa_again"] == 0.0
    assert any(f.endswith(".png") for f in os.listdir(tmp_path))


def test_decode_example_agrees_with_recomputation(tmp_path):
    """examples/decode_kvcache.py at the CPU size: the cached decoding picks the tokens that
    recomputing the whole prefix picks."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "decode_kvcache.py"), "--out", str(tmp_path)],
                   check=True, env=env, stdout=subprocess.PIPE)
    record = json.load(open(tmp_path / "decode_tiny_cpu.json"))
    assert record["token_agreement"] == 1.0 and record["first_step_max_logit_diff"] < 1e-4
