"""Synthetic layers files and links for planner tests and benchmarks (no host is measured).

A synthetic host runs every block ``speed`` times faster than a unit host whose block times
are given explicitly, so optimal plans can be worked out by hand.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

from ..formats import GB, Bandwidth, BlockProfile, LayersFile, ModelInfo, RunInfo

if TYPE_CHECKING:
    from ..cost import MemoryEstimator
    from ..formats import Plan


def layers_file(host: str, *, num_layers: int = 4, speed: float = 1.0, batch: int = 4, seq_len: int = 16,
                layer_fwd_s: Sequence[float] | float = 1.0, layer_bwd_s: Sequence[float] | float | None = None,
                embed_fwd_s: float = 0.1, tail_fwd_s: float = 0.5, layer_param_bytes: Sequence[int] | int = 1000,
                embed_param_bytes: int = 4000, tail_param_bytes: int = 4100, act_bytes_per_sample: int = 64,
                tied: bool = True, model_name: str = "synthetic", hidden_size: int = 8,
                vocab_size: int = 500, fixed_fraction: float = 0.0) -> LayersFile:
    """A layers file whose block times are the given unit times / ``speed`` (for ``batch`` samples),
    ``fixed_fraction`` of each paid per call whatever the samples."""
    fw = [float(layer_fwd_s)] * num_layers if isinstance(layer_fwd_s, (int, float)) else list(layer_fwd_s)
    if layer_bwd_s is None:
        bw = [2 * x for x in fw]
    elif isinstance(layer_bwd_s, (int, float)):
        bw = [float(layer_bwd_s)] * num_layers
    else:
        bw = list(layer_bwd_s)
    pb = [int(layer_param_bytes)] * num_layers if isinstance(layer_param_bytes, int) else list(layer_param_bytes)
    if not (len(fw) == len(bw) == len(pb) == num_layers):
        raise ValueError("per-layer lists must have num_layers entries")

    def blk(name: str, index: int | None, f: float, b: float, p: int) -> BlockProfile:
        return BlockProfile(name=name, index=index, param_bytes=p, activation_bytes_per_sample=act_bytes_per_sample,
                            forward_time_s=f / speed, backward_time_s=b / speed,
                            forward_fixed_s=fixed_fraction * f / speed, backward_fixed_s=fixed_fraction * b / speed)

    layers = [blk(f"layer{i}", i, fw[i], bw[i], pb[i]) for i in range(num_layers)]
    embed = blk("embed", None, embed_fwd_s, 2 * embed_fwd_s, embed_param_bytes)
    tail = blk("tail", None, tail_fwd_s, 2 * tail_fwd_s, tail_param_bytes)
    total = sum(b.forward_time_s + b.backward_time_s for b in [embed, *layers, tail])
    return LayersFile(
        host=host,
        model=ModelInfo(name=model_name, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                        tied_embeddings=tied),
        run=RunInfo(seq_len=seq_len, batch=batch, iters=3, warmup=1, threads=1, torch_version="synthetic",
                    timer="python"),
        embed_param_bytes=embed_param_bytes, tail_param_bytes=tail_param_bytes, embed=embed, tail=tail,
        layers=layers, step_time_s=total, peak_rss_bytes=0)


def uniform_links(hosts: Sequence[str], bytes_per_sec: float = 1e9, latency_s: float = 0.0) -> Bandwidth:
    return Bandwidth(bytes_per_sec={Bandwidth.key(a, b): bytes_per_sec for a in hosts for b in hosts if a != b},
                     latency_s={Bandwidth.key(a, b): latency_s for a in hosts for b in hosts if a != b and latency_s},
                     source="synthetic")


def random_instance(rng: random.Random, *, hosts: int, layers: int, batch: int = 4, tied: bool = True
                    ) -> tuple[list[LayersFile], Bandwidth, dict[str, int]]:
    """Random speeds, layer costs, link rates and memories: (layers files, links, memory bytes per host)."""
    names = [f"h{i}" for i in range(hosts)]
    fw = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    act = rng.randint(100, 2000)
    pb = [rng.randint(500, 3000) for _ in range(layers)]
    files = [layers_file(h, num_layers=layers, speed=rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]), batch=batch,
                         layer_fwd_s=fw, layer_param_bytes=pb, embed_fwd_s=rng.uniform(0.05, 0.5),
                         tail_fwd_s=rng.uniform(0.5, 3.0), act_bytes_per_sample=act, tied=tied)
             for h in names]
    bw = Bandwidth(bytes_per_sec={Bandwidth.key(a, b): rng.choice([2e3, 1e4, 5e4, 1e6])
                                  for a in names for b in names if a != b}, source="synthetic")
    need = 4 * (sum(pb) + 8100) + 16 * act * (layers + 2) * batch
    mem = {h: int(rng.uniform(0.15, 1.0) * need) for h in names}
    return files, bw, mem


def qwen_like(rng: random.Random, hosts: int, layers: int) -> tuple[list[LayersFile], Bandwidth, dict[str, int]]:
    """CPU hosts running a Qwen3-0.6B-shaped model (a tail as dear as ten decoder layers, hosts 0.5-3x
    the reference speed with 2-16 GiB, links 0.1-1 Gbit/s): the planner benchmarks' clusters."""
    names = [f"cpu{i}" for i in range(hosts)]
    layer_s = 0.8  # one decoder layer forward for 4 samples of 512 tokens on the reference host
    files = [layers_file(h, num_layers=layers, speed=rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]), batch=4, seq_len=512,
                         layer_fwd_s=[layer_s * rng.uniform(0.95, 1.05) for _ in range(layers)],
                         embed_fwd_s=0.05, tail_fwd_s=10 * layer_s, layer_param_bytes=62_923_776,
                         embed_param_bytes=622_329_856, tail_param_bytes=622_333_952,
                         act_bytes_per_sample=512 * 1024 * 4) for h in names]
    rates = {Bandwidth.key(a, b): rng.choice([0.1, 0.5, 1.0]) * 1e9 / 8 for a in names for b in names if a != b}
    mem = {h: rng.choice([2, 4, 8, 16]) * GB for h in names}
    return files, Bandwidth(bytes_per_sec=rates, latency_s={k: 2e-4 for k in rates}), mem


SEED000_HOSTS = {"host0": (1.0, 8), "host1": (0.7, 4), "host2": (0.5, 4), "host3": (0.35, 2)}
"""Seed 000's 4-host instance: capacity (speed relative to host0) and memory in GB per host."""
SEED000_PLAN = [((0, 12), "host0"), ((12, 20), "host1"), ((20, 25), "host2"), ((25, 28), "host3")]
"""Seed 000's own plan on that instance: layer range and host per stage."""


def seed000_instance() -> tuple[list[LayersFile], Bandwidth, dict[str, int], "MemoryEstimator"]:
    """Seed 000's instance (Qwen3-0.6B-like): 28 equal layers of 0.12 s forward and 0.24 s backward
    for a batch of 4 on host0, hosts of speed 1/0.7/0.5/0.35 with 8/4/4/2 GB, every link 12.5e6 B/s,
    memory model base 5e8 B, alpha 4, Kp 2. Returns (layers files, links, memory bytes, memory model)."""
    from ..cost import MemoryEstimator

    files = [layers_file(h, num_layers=28, speed=speed, batch=4, seq_len=512, layer_fwd_s=0.12, layer_bwd_s=0.24,
                         embed_fwd_s=0.0, tail_fwd_s=0.0, layer_param_bytes=62_923_776,
                         embed_param_bytes=622_329_856, tail_param_bytes=622_333_952,
                         act_bytes_per_sample=2_097_152, tied=True, model_name="qwen3-0.6b-like",
                         hidden_size=1024, vocab_size=151_936)
             for h, (speed, _) in SEED000_HOSTS.items()]
    mem = {h: gb * GB for h, (_, gb) in SEED000_HOSTS.items()}
    memory = MemoryEstimator(5e8, 4.0, 2.0, "seed 000 (base 5e8 B, alpha 4, Kp 2)")
    return files, uniform_links(list(SEED000_HOSTS), 12.5e6), mem, memory


SEED000_8HOSTS = {f"cpu{i + 1}": SEED000_HOSTS[f"host{i % 4}"][0] for i in range(8)}
"""Seed 000's 8-host instance: its devices.json (cpu1..cpu8, 24 GB each); the seed gives no speeds,
so the 4-host instance's capacities are repeated (1, 0.7, 0.5, 0.35, 1, 0.7, 0.5, 0.35)."""


def seed000_8host_instance() -> tuple[list[LayersFile], Bandwidth, dict[str, int], "MemoryEstimator"]:
    """Seed 000's 8-host instance: the 4-host instance's model, links and memory model on
    :data:`SEED000_8HOSTS` with 24 GB each (the seed's devices.json)."""
    files4, _, _, memory = seed000_instance()
    ref = files4[0]
    files = [layers_file(h, num_layers=28, speed=speed, batch=4, seq_len=512, layer_fwd_s=0.12, layer_bwd_s=0.24,
                         embed_fwd_s=0.0, tail_fwd_s=0.0, layer_param_bytes=62_923_776,
                         embed_param_bytes=622_329_856, tail_param_bytes=622_333_952,
                         act_bytes_per_sample=2_097_152, tied=True, model_name=ref.model.name,
                         hidden_size=1024, vocab_size=151_936)
             for h, speed in SEED000_8HOSTS.items()]
    return files, uniform_links(list(SEED000_8HOSTS), 12.5e6), {h: 24 * GB for h in SEED000_8HOSTS}, memory


def seed000_plan(model: ModelInfo, global_batch: int = 20, micro_batch_size: int = 4) -> "Plan":
    """Seed 000's own plan ``[0,12) host0 | [12,20) host1 | [20,25) host2 | [25,28) host3`` under 1F1B."""
    from ..plans import make_plan

    return make_plan(model, seq_len=512, global_batch=global_batch,
                     num_microbatches=global_batch // micro_batch_size, layer_ranges=[r for r, _ in SEED000_PLAN],
                     group_sizes=[1] * len(SEED000_PLAN), hosts=[h for _, h in SEED000_PLAN], strategy="seed000")
