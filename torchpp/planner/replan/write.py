"""The corrected files of a re-plan: each host's layers file with its corrected times, and the rest."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ...formats import Bandwidth, BlockProfile, Devices, LayersFile, MemoryModel, Plan, RunInfo
from ...cost import Profiles



# ----------------------------------------------------------------------------- files
def template_from_model(plan: Plan) -> LayersFile:
    """A layers file shaped by the model's per-block FLOPs at a nominal 1 GFLOP/s (no host measured);
    the fitted factors then turn it into each host's measured times."""
    from ..estimate import DTYPE_BYTES, block_params
    from ...models.presets import hidden_size

    cfg, params = block_params(plan.model.source if plan.model.source not in ("", "preset") else plan.model.name,
                               plan.model.num_layers)
    by = DTYPE_BYTES.get(plan.model.dtype, 4)
    h, V, L, S = hidden_size(cfg), int(cfg.vocab_size), plan.model.num_layers, plan.seq_len
    flops = [2.0 * S * h] + [2.0 * params[1 + i] * S + 4.0 * S * S * h for i in range(L)] + [2.0 * h * V * S]
    nominal = 1e9

    def blk(name, idx, fl, p, act):
        return BlockProfile(name=name, index=idx, param_bytes=int(p * by), activation_bytes_per_sample=int(act),
                            forward_time_s=fl / nominal, backward_time_s=2 * fl / nominal)

    act = S * h * by
    layers = [blk(f"layer{i}", i, flops[1 + i], params[1 + i], act) for i in range(L)]
    embed, tail = blk("embed", None, flops[0], params[0], act), blk("tail", None, flops[-1], params[-1], S * V * by)
    return LayersFile(host="model-estimate", model=plan.model,
                      run=RunInfo(seq_len=S, batch=1, iters=1, warmup=0, threads=1, torch_version="estimate",
                                  timer="python", cpu="per-block FLOPs at a nominal 1 GFLOP/s"),
                      embed_param_bytes=embed.param_bytes, tail_param_bytes=tail.param_bytes, embed=embed, tail=tail,
                      layers=layers, step_time_s=3 * sum(flops) / nominal, peak_rss_bytes=0)


def corrected_layers_file(template: LayersFile, host: str, f: np.ndarray, b: np.ndarray, f0: np.ndarray,
                          b0: np.ndarray, call_s: float = 0.0, split: float | None = None,
                          optimizer_s_per_byte: float | None = None, split_layer_s: float | None = None) -> LayersFile:
    """``template``'s bytes and run with ``host``'s corrected times (per sample ``f``/``b``, per call
    ``f0``/``b0``), split-backward factor and optimizer rate; raw samples and per-batch means are
    dropped: these are corrected figures."""
    n = template.run.batch
    blocks = [template.embed, *template.layers, template.tail]
    new = [BlockProfile(name=bl.name, index=bl.index, param_bytes=bl.param_bytes,
                        activation_bytes_per_sample=bl.activation_bytes_per_sample,
                        forward_time_s=float(f0[j] + f[j] * n), backward_time_s=float(b0[j] + b[j] * n),
                        forward_fixed_s=float(f0[j]), backward_fixed_s=float(b0[j]))
           for j, bl in enumerate(blocks)]
    return LayersFile(host=host, model=template.model, run=template.run, embed_param_bytes=template.embed_param_bytes,
                      tail_param_bytes=template.tail_param_bytes, embed=new[0], tail=new[-1], layers=new[1:-1],
                      step_time_s=float(f0.sum() + b0.sum() + (f.sum() + b.sum()) * n),
                      peak_rss_bytes=template.peak_rss_bytes, call_overhead_s=float(call_s),
                      backward_split_factor=split, optimizer_s_per_byte=optimizer_s_per_byte or None,
                      backward_split_layer_s=split_layer_s)


@dataclass
class Written:
    """The corrected inputs written to the output folder (what the new plan is priced from)."""

    layers: list[Path]
    bandwidth: Path
    capacities: Path
    memory_model: Path | None = None
    devices: Path | None = None

    @property
    def files(self) -> list[Path]:
        """The files ``replan_summary.json`` lists as written (devices.json is a copy, not a correction)."""
        return [*self.layers, self.bandwidth, self.capacities] + ([self.memory_model] if self.memory_model else [])

    @property
    def sources(self) -> dict[str, Any]:
        """The planning API's ``sources`` (what plan_meta.json names as the inputs)."""
        out: dict[str, Any] = {"layers": self.layers, "bandwidth": self.bandwidth}
        if self.memory_model is not None:
            out["memory_model"] = self.memory_model
        if self.devices is not None:
            out["devices"] = self.devices
        return out


def write_corrected(out: Path, hosts: Sequence[str], templates: Mapping[str, LayersFile], default: LayersFile,
                    profiles: Profiles, bandwidth: Bandwidth, ref: str, memory_model: MemoryModel | None,
                    devices: Devices | None, optimizer: Mapping[str, float] | None = None) -> Written:
    """Write every host's corrected layers file (with its fitted ``optimizer`` rate: the files alone
    then price a plan as the re-plan did), the bandwidth, capacities (relative to ``ref``, or the
    first host when ``ref`` is not among ``hosts``), memory model and devices files."""
    from ..capacities import compute_capacities

    out.mkdir(parents=True, exist_ok=True)
    layers = []
    for h in hosts:
        lf = corrected_layers_file(templates.get(h, default), h, profiles.fwd[h], profiles.bwd[h], profiles.fwd0[h],
                                   profiles.bwd0[h], profiles.call.get(h, 0.0), profiles.split_factor.get(h),
                                   (optimizer or {}).get(h), profiles.split_layer.get(h))
        layers.append(lf.save(out / f"layers_{h}.json"))
    bandwidth.save(out / "bandwidth.json")
    w = Written(layers=layers, bandwidth=out / "bandwidth.json", capacities=out / "capacities.json")
    new_files = [LayersFile.load(p) for p in layers]
    compute_capacities(new_files, ref if ref in hosts else hosts[0]).save(w.capacities)
    if memory_model is not None:
        memory_model.save(out / "memory_model.json")
        w.memory_model = out / "memory_model.json"
    if devices is not None:
        devices.save(out / "devices.json")
        w.devices = out / "devices.json"
    return w
