"""Work bounded by what the host can hold: sizes are checked before anything is allocated."""
from __future__ import annotations

from torchpp.cli import main


def test_profile_refuses_a_batch_whose_activations_exceed_the_host(capsys):
    assert main(["profile", "--model", "qwen3-tiny", "--batch", "100000000", "--no-call-probe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch 100000000 x --seq-len 128: one step needs at least" in err[0], err
