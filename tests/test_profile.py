"""`torchpp profile`: the layers file it writes, its trace, local checkpoints, bad arguments."""
import json

import pytest
import torch

from torchpp.cli import main
from torchpp.formats import FormatError, LayersFile
from torchpp.models.presets import build_model
from torchpp.profiling import timer as tm
from torchpp.trace.chrome import load_trace


@pytest.fixture(autouse=True)
def _threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _profile(tmp_path, *extra, model="qwen3-tiny", name="h1"):
    out = tmp_path / f"layers_{name}.json"
    rc = main(["profile", "--model", str(model), "--seq-len", "16", "--batch", "2", "--iters", "2", "--warmup", "1",
               "--threads", "1", "--host", name, "--out", str(out), "--no-call-probe", *extra])  # the probe: test_call_probe
    assert rc == 0
    return LayersFile.load(out), out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prof")
    lf, out = _profile(tmp, "--trace", str(tmp / "trace.json"))
    return lf, out, tmp / "trace.json"


def test_layers_file_fields_are_measured(qwen):
    lf, _, _ = qwen
    m = build_model("qwen3-tiny")
    assert lf.host == "h1" and lf.model.name == "qwen3-tiny" and lf.model.num_layers == 4
    assert lf.run.seq_len == 16 and lf.run.batch == 2 and lf.run.iters == 2 and lf.run.warmup == 1
    assert lf.run.timer == ("cpp" if tm._ext is not None else "python")
    assert lf.run.torch_version == torch.__version__
    for i, layer in enumerate(lf.layers):
        assert layer.index == i and layer.name == f"layer{i}"
        # Measured from the block's output tensor: seq_len × hidden × dtype bytes.
        assert layer.activation_bytes_per_sample == 16 * 64 * 4
        want = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n.startswith(f"model.layers.{i}."))
        assert layer.param_bytes == want
    for b in [lf.embed, *lf.layers, lf.tail]:
        assert b.forward_time_s > 0 and b.backward_time_s > 0, b.name
        assert len(b.forward_samples_s) == len(b.backward_samples_s) == 2
        assert b.forward_time_s == pytest.approx(sum(b.forward_samples_s) / 2)
    assert lf.embed_param_bytes == lf.embed.param_bytes == 512 * 64 * 4
    assert lf.tail_param_bytes == lf.tail.param_bytes == (512 * 64 + 64) * 4  # tied lm_head counted at the tail
    assert lf.embed.activation_bytes_per_sample == 16 * 64 * 4 and lf.tail.activation_bytes_per_sample == 16 * 512 * 4
    assert lf.peak_rss_bytes > 50 * 2**20 and len(lf.step_samples_s) == 2
    blocks = sum(b.forward_time_s + b.backward_time_s for b in [lf.embed, *lf.layers, lf.tail])
    assert blocks <= lf.step_time_s


def test_layers_file_round_trips(qwen, tmp_path):
    lf, out, _ = qwen
    lf.save(tmp_path / "again.json")
    assert LayersFile.load(tmp_path / "again.json") == lf
    assert json.loads(out.read_text())["format"] == "torchpp.layers/1"


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(format="torchpp.plan/1"), "format"),
    (lambda d: d["layers"][1].update(backward_time_s=0), "layers[1].backward_time_s"),
    (lambda d: d["layers"][0].pop("activation_bytes_per_sample"), "layers[0].activation_bytes_per_sample"),
    (lambda d: d["layers"].pop(), "layers"),
    (lambda d: d["layers"][2].update(index=5), "layers[2].index"),
    (lambda d: d["run"].update(timer="gpu"), "run.timer"),
    (lambda d: d["tail"].update(forward_samples_s=[0.1, -1]), "tail.forward_samples_s[1]"),
    (lambda d: d.update(embed_param_bytes="big"), "embed_param_bytes"),
    (lambda d: d["model"].pop("hidden_size"), "model.hidden_size"),
])
def test_malformed_layers_file_names_the_field(qwen, tmp_path, mutate, field):
    d = json.loads(qwen[1].read_text())
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(FormatError) as e:
        LayersFile.load(f)
    assert e.value.field_path == field and str(f) in str(e.value) and "expected" in str(e.value)


def test_trace_has_a_forward_and_backward_event_per_block_and_step(qwen):
    lf, _, trace = qwen
    ev = [e for e in load_trace(trace)["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in ev}
    for b in ["embed", "layer0", "layer3", "tail"]:
        assert f"{b} fwd" in names and f"{b} bwd" in names
    assert sum(e["name"] == "layer2 bwd" for e in ev) == 2 and {"F0", "B0", "F1", "B1"} <= names
    f0 = next(e for e in ev if e["name"] == "F0")
    inner = [e for e in ev if e["name"].endswith(" fwd") and e["args"]["iteration"] == 0]
    assert all(f0["ts"] <= e["ts"] and e["ts"] + e["dur"] <= f0["ts"] + f0["dur"] + 1e-3 for e in inner)


def test_bfloat16_python_timer_and_fewer_layers(tmp_path):
    lf, _ = _profile(tmp_path, "--dtype", "bfloat16", "--timer", "python", "--layers", "2", model="gpt2-tiny")
    # --dtype bfloat16 is mixed precision: fp32 weights under bf16 autocast; the residual stream
    # between blocks stays fp32 (fp32 residual + bf16 branch), as training sends it
    assert lf.run.timer == "python" and lf.model.num_layers == 2
    assert (lf.model.dtype, lf.model.autocast, lf.model.precision) == ("float32", "bfloat16", "bfloat16")
    assert [x.activation_bytes_per_sample for x in lf.layers] == [16 * 64 * 4] * 2
    assert all(b.backward_time_s > 0 for b in [lf.embed, *lf.layers, lf.tail])


def test_local_checkpoint_directory_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt = tmp_path / "ckpt"
    build_model("llama-tiny").save_pretrained(ckpt)
    lf, _ = _profile(tmp_path, model=ckpt, name="local")
    ref = build_model("llama-tiny")
    assert lf.model.source == "path" and lf.model.name == "ckpt" and lf.model.architecture == "llama"
    assert lf.embed_param_bytes == ref.model.embed_tokens.weight.numel() * 4
    assert lf.tail_param_bytes == (ref.lm_head.weight.numel() + ref.model.norm.weight.numel()) * 4
    assert lf.layers[0].activation_bytes_per_sample == 16 * 64 * 4


@pytest.mark.parametrize("args,arg", [
    (["--model", "qwen9-huge"], "--model"),
    (["--model", "/nonexistent/ckpt"], "--model"),
    (["--model", "qwen3-tiny", "--batch", "0"], "--batch"),
    (["--model", "qwen3-tiny", "--batch", "-3"], "--batch"),
    (["--model", "qwen3-tiny", "--dtype", "float64"], "--dtype"),
    (["--model", "qwen3-tiny", "--seq-len", "0"], "--seq-len"),
    (["--model", "gpt2-tiny", "--seq-len", "5000"], "--seq-len"),
    (["--model", "qwen3-tiny", "--iters", "0"], "--iters"),
    (["--model", "qwen3-tiny", "--layers", "9"], "--layers"),
    (["--model", "qwen3-tiny", "--timer", "fast"], "--timer"),
])
def test_bad_arguments_exit_2_with_one_line(args, arg, tmp_path, capsys):
    rc = main(["profile", *args, "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and arg in err, err
    assert not (tmp_path / "x.json").exists()


def test_progress_and_summary_are_shown(tmp_path, capsys):
    _profile(tmp_path, "--iters", "2", "--warmup", "1", model="gpt2-tiny", name="p")
    cap = capsys.readouterr()
    lines = [x for x in cap.err.splitlines() if x.startswith("[profile]")]
    assert [x.split(":")[0] for x in lines] == ["[profile] gpt2-tiny warmup 1/1", "[profile] gpt2-tiny measure 1/2",
                                               "[profile] gpt2-tiny measure 2/2"]
    assert "blocks cover" in cap.out and "layer3" in cap.out and f"wrote {tmp_path}" in cap.out


def test_several_batch_sizes_fit_the_per_call_time(tmp_path):
    """--batch 1,4: every size is measured, the block times are the largest's, and each block's
    per-call time is the non-negative intercept of a least-squares line through the sizes."""
    from torchpp.profiling.measure import fit_fixed

    lf, out = _profile(tmp_path, "--batch", "1,4", "--seq-len", "32", model="qwen3-tiny", name="b")
    assert lf.run.batch == 4 and lf.run.batches == [1, 4]
    for b in [lf.embed, *lf.layers, lf.tail]:
        assert [r[0] for r in b.batch_times_s] == [1.0, 4.0]
        assert b.batch_times_s[1][1] == pytest.approx(b.forward_time_s)
        f0, b0 = fit_fixed(b.batch_times_s)
        assert b.forward_fixed_s == pytest.approx(min(f0, b.forward_time_s))
        assert 0 <= b.forward_fixed_s <= b.forward_time_s and 0 <= b.backward_fixed_s <= b.backward_time_s
    assert LayersFile.load(out) == lf
    # two exact points: the intercept is where the line through them meets zero samples
    assert fit_fixed([[1, 3.0, 5.0], [4, 6.0, 11.0]]) == pytest.approx((2.0, 3.0))
    assert fit_fixed([[1, 1.0, 1.0], [4, 0.5, 2.0]])[0] == pytest.approx(0.75)  # slope clipped at 0: the mean
    assert fit_fixed([[2, 1.0, 1.0]]) == (0.0, 0.0)


def test_bad_batch_list_is_one_line_error(tmp_path, capsys):
    rc = main(["profile", "--model", "qwen3-tiny", "--batch", "1,x", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "--batch" in capsys.readouterr().err
