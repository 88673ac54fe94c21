"""One pipeline stage of a HuggingFace causal LM, built on its rank alone.

The whole model is constructed with its parameters on the meta device (no memory) and its
buffers computed for real by their own constructors, its blocks are found with
:func:`torchpp.models.blocks.find_parts`, every module the stage does not own is dropped, and
only what is left is materialised: with a preset it is initialised
per parameter name (``presets.init_parameters``), so the stage holds exactly the tensors the
whole model would hold; with a local checkpoint only the stage's tensors are read (safetensors
``safe_open``). Parameter names stay the HF names (``model.layers.5.mlp.up_proj.weight``), so
checkpoints written by the stages together load into the HF model.

A stage computes exactly what the whole model computes: positions are rebuilt per stage,
rotary cos/sin are recomputed from the stage's own ``rotary_emb`` buffers, the masks are
rebuilt per stage with the model's own mask functions (eager attention without a mask would
silently attend to the future), each layer keeps its original index, and the model-level
scalings of the config are applied (:mod:`torchpp.models.semantics`). Dropout draws from a
stream seeded per (seed, step, micro-batch, block), the same whatever the split.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .deferred import Deferred, add_grad, collecting, defer_weight_gradients, project
from .presets import DTYPES, ModelSpecError, init_parameters, is_preset, resolve_model


# ----------------------------------------------------------------------------- where the blocks live
@dataclass(frozen=True, slots=True)
class StagePaths:
    """Module paths of the blocks (from :func:`torchpp.models.blocks.find_parts`) and how they are called."""

    embed: tuple[str, ...]
    """Embedding modules in forward order; ``token`` is the one indexed by token ids."""
    token: str
    positions: tuple[str, ...]
    """Learned position embeddings (GPT-2's ``wpe``), added to the token embedding."""
    dropouts: tuple[str, ...]
    layers: str
    norm: str
    lm_head: str
    rotary: str | None

    @property
    def embed_weight(self) -> str:
        """The parameter a tied lm_head shares."""
        return f"{self.token}.weight"

    @staticmethod
    def of(model: nn.Module) -> "StagePaths":
        from .blocks import UnsupportedModelError, find_parts

        try:
            parts = find_parts(model)
        except UnsupportedModelError as e:
            raise ModelSpecError(str(e)) from None
        tok = model.get_input_embeddings()
        token = next(p for p in parts.embed_paths if model.get_submodule(p) is tok)
        positions = tuple(p for p in parts.embed_paths if p != token and isinstance(model.get_submodule(p), nn.Embedding))
        drops = tuple(p for p in parts.embed_paths if isinstance(model.get_submodule(p), nn.Dropout))
        other = set(parts.embed_paths) - {token, *positions, *drops}
        if other:
            raise ModelSpecError(f"{type(model).__name__}: embedding modules {sorted(other)} are neither token/position "
                                 "embeddings nor dropout; torchpp cannot run them in a stage")
        return StagePaths(embed=tuple(parts.embed_paths), token=token, positions=positions, dropouts=drops,
                          layers=parts.layers_path, norm=parts.norm_path, lm_head=parts.lm_head_path,
                          rotary=parts.rotary_path)


def _get(root: nn.Module, path: str) -> nn.Module | None:
    m = root
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def _set(root: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, leaf, value)


# ----------------------------------------------------------------------------- the stage
class BlockObserver(Protocol):
    """Told when each block (``embed``, ``layer<i>``, ``tail``) starts and ends its forward."""

    def begin(self, name: str) -> None: ...

    def end(self, name: str, inp: torch.Tensor | None, out: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class StageSpec:
    """What a rank owns: a layer range, the embed and/or tail, and which layers to recompute."""

    layers: tuple[int, int]
    has_embed: bool
    has_tail: bool
    recompute: tuple[bool, ...] = ()
    num_stages: int = 1

    @staticmethod
    def from_plan(plan, index: int) -> "StageSpec":
        s = plan.stages[index]
        return StageSpec(layers=tuple(s.layers), has_embed=s.has_embed, has_tail=s.has_tail,
                         recompute=tuple(s.recompute), num_stages=plan.num_stages)

    @staticmethod
    def whole(num_layers: int) -> "StageSpec":
        return StageSpec(layers=(0, num_layers), has_embed=True, has_tail=True)


KEPT_MASK_BYTES = 1 << 20
"""The largest attention masks (all of a stage's types together) a stage keeps between micro-batches."""


class Stage:
    """The pruned HF model of one stage and the forward that stage runs.

    ``module`` is the ``*ForCausalLM`` with foreign blocks removed (set to ``None`` or to an
    empty placeholder inside the layer list, so layer indices and parameter names are kept).
    """

    def __init__(self, module: nn.Module, cfg, spec: StageSpec, parts: StagePaths):
        self.module, self.cfg, self.spec, self.parts = module, cfg, spec, parts
        self.layer_list = _get(module, parts.layers)
        self.profiler: BlockObserver | None = None
        self.seed = 0
        self.rng_key: tuple[int, int] | None = None
        """(step, micro-batch) of the pass being run; set by the executor so dropout is split-invariant."""
        self.tied_copy = bool(getattr(cfg, "tie_word_embeddings", False)) and spec.has_tail and not spec.has_embed
        self.autocast: torch.dtype | None = None
        """Mixed precision: run the forward under CPU autocast to this dtype (weights stay as they are)."""
        self._inputs: dict[tuple, tuple] = {}
        """The layers' masks and rotary cos/sin by input shape (``_layer_inputs``)."""
        self._positions_by_len: dict[tuple[int, torch.device], torch.Tensor] = {}

    # -- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def defer_weight_gradients(self, enable: bool = True) -> int:
        """Let ``backward_input`` set the linear layers' weight gradients aside for ``backward_weight``
        (zero-bubble schedules; ``enable=False`` undoes it); returns how many layers do."""
        return defer_weight_gradients(self.module, enable)

    def tied_parameter(self) -> nn.Parameter | None:
        """The tied embedding / lm_head weight this stage holds (first or last stage), if tied."""
        if not getattr(self.cfg, "tie_word_embeddings", False) or self.spec.num_stages == 1:
            return None
        if self.spec.has_embed:
            return _get(self.module, self.parts.token).weight
        if self.spec.has_tail:
            return _get(self.module, self.parts.lm_head).weight
        return None

    def source_name(self, name: str) -> str:
        """The name under which ``name``'s initial value lives in the whole model."""
        if self.tied_copy and name == f"{self.parts.lm_head}.weight":
            return self.parts.embed_weight
        return name

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.cfg, "hidden_size", None) or getattr(self.cfg, "n_embd"))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def train(self, mode: bool = True) -> "Stage":
        self.module.train(mode)
        return self

    # -- compute
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, n_tokens: int | None = None) -> torch.Tensor:
        """:meth:`_forward`, under autocast when the stage is mixed precision; hidden states leave
        in the weights' dtype, so the receiving stage's buffers and the wire format do not change."""
        if self.autocast is None:
            return self._forward(x, labels, n_tokens)
        with torch.autocast("cpu", dtype=self.autocast):
            out = self._forward(x, labels, n_tokens)
        return out if self.spec.has_tail else out.to(self.dtype)

    def _forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, n_tokens: int | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states, or the loss on the last stage.

        The loss is the sum of token cross-entropies over this input divided by ``n_tokens``
        (the count of predicted tokens in the whole global batch), so summing every rank's and
        every micro-batch's losses gives the global mean, as single-process training does.
        """
        spec = self.spec
        prof = self.profiler
        T = x.shape[1]
        pos = self._positions(T, x.device)
        h = x
        if spec.has_embed:
            if prof:
                prof.begin("embed")
            with self._dropout_stream(self.rng_key, -1):
                h = self._embed(x, pos)
            if prof:
                prof.end("embed", None, h)
        a, b = spec.layers
        if b > a:
            call = self._layer_caller(h, pos)
            for i in range(a, b):
                rec = spec.recompute[i - a] if spec.recompute else False
                layer = self.layer_list[i]
                if prof:
                    prof.begin(f"layer{i}")
                out = checkpoint(call, layer, i, h, use_reentrant=False) if rec and torch.is_grad_enabled() \
                    else call(layer, i, h)
                if isinstance(out, tuple):  # layers that still return (hidden, ...) (Falcon)
                    out = out[0]
                if prof:
                    prof.end(f"layer{i}", h, out)
                h = out
        if not spec.has_tail:
            return h
        if labels is None or n_tokens is None:
            raise ValueError("the last stage needs labels and n_tokens to compute the loss")
        if prof:
            prof.begin("tail")
        loss = self.loss(self.logits(h), labels, n_tokens)
        if prof:
            prof.end("tail", h, loss)
        return loss

    def _embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        from .embedding import embed

        m = self.module
        h = embed(_get(m, self.parts.token), ids)
        for p in self.parts.positions:
            h = h + _get(m, p)(pos)
        mult = getattr(self.cfg, "embedding_multiplier", None)  # Granite scales the embedding output
        if mult is not None and mult != 1:
            h = h * mult
        for p in self.parts.dropouts:
            h = _get(m, p)(h)
        return h

    def _positions(self, T: int, device: torch.device) -> torch.Tensor:
        pos = self._positions_by_len.get((T, device))
        if pos is None:
            pos = self._positions_by_len[(T, device)] = torch.arange(T, device=device).unsqueeze(0)
        return pos

    def _layer_inputs(self, h: torch.Tensor, pos: torch.Tensor) -> tuple:
        """``semantics.layer_inputs`` once per input shape: the masks and rotary cos/sin depend on the
        shape, dtype and device of the hidden states, not their values, and rebuilding them took ~0.2 ms
        of every micro-batch's forward on a small stage. A rotary embedding that rescales itself with
        the sequences it has seen (dynamic and long RoPE) is asked every time, and a mask larger than
        :data:`KEPT_MASK_BYTES` (eager attention's batch × length² table) is not kept: it would stay
        in memory through the step's peak, where it now lives only during a forward."""
        from .semantics import layer_inputs

        key = (tuple(h.shape[:-1]), h.dtype, h.device, torch.is_autocast_enabled("cpu"),
               torch.get_autocast_dtype("cpu"), torch.is_inference_mode_enabled())
        hit = self._inputs.get(key)
        if hit is None:
            hit = layer_inputs(self.cfg, self.module, self.parts, h, pos, self.spec.layers[1])
            masks = sum(m.numel() * m.element_size() for m in hit[0].values() if isinstance(m, torch.Tensor))
            if self._inputs_fixed() and masks <= KEPT_MASK_BYTES:
                self._inputs[key] = hit
        return hit

    def _inputs_fixed(self) -> bool:
        rot = None if self.parts.rotary is None else _get(self.module, self.parts.rotary)
        kind = str(getattr(rot, "rope_type", "default"))
        return "dynamic" not in kind and "longrope" not in kind

    def _layer_caller(self, h: torch.Tensor, pos: torch.Tensor) -> Callable:
        """A function (layer, index, hidden) -> hidden with this stage's masks and rotary cos/sin."""
        masks, rotary, types, extra = self._layer_inputs(h, pos)
        key = self.rng_key  # fixed now: a recompute in the backward runs after later forwards

        def call(layer: nn.Module, i: int, x: torch.Tensor) -> torch.Tensor:
            kw = dict(extra)
            if rotary is not None:
                kw["position_embeddings"] = rotary[types[i]]
            with self._dropout_stream(key, i):
                return layer(x, attention_mask=masks[types[i]], position_ids=pos, **kw)
        return call

    def _dropout_stream(self, key: tuple[int, int] | None, block: int):
        """Seed the random stream of one block from (seed, step, micro-batch, block), so dropout
        draws the same masks however the model is split (a no-op outside training)."""
        if key is None or not self.module.training:
            return contextlib.nullcontext()
        return _seeded(self.seed, *key, block)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        from .semantics import scale_logits

        h = _get(self.module, self.parts.norm)(h)
        return scale_logits(self.cfg, project(_get(self.module, self.parts.lm_head), h))

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """HF's causal-LM loss (shift by one, ignore -100, fp32) summed, divided by ``n_tokens``."""
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                               ignore_index=-100, reduction="sum")
        return ce / n_tokens


@contextlib.contextmanager
def _seeded(*key: int):
    """Run the block on the CPU generator seeded from ``key``, then restore its state. Only the
    CPU generator is touched: ``torch.manual_seed`` would also queue a lazy seed for every
    accelerator, formatting the Python stack each time (~0.3 ms, run per block per micro-batch)."""
    seed = int.from_bytes(hashlib.sha256(":".join(map(str, key)).encode()).digest()[:8], "little") & ((1 << 63) - 1)
    gen = torch.default_generator
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


def count_targets(labels: torch.Tensor) -> int:
    """Predicted tokens of a batch: every position whose next label is not -100."""
    return int((labels[..., 1:] != -100).sum())


# ----------------------------------------------------------------------------- building
def build_stage(model: str, cfg, spec: StageSpec, *, seed: int = 0, dtype: str = "float32",
                weights: str | Path | None = None, autocast: str = "", random_weights: bool = False) -> Stage:
    """Materialise only ``spec``'s modules; weights from ``weights`` (a directory with safetensors)
    or, for a preset, the seeded per-name init; a local model path loads its own checkpoint
    (``random_weights``: the seeded init whatever the model, for timings)."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ModelSpecError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    n = int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))
    a, b = spec.layers
    if not (0 <= a <= b <= n):
        raise ModelSpecError(f"stage layers [{a}, {b}): expected a range inside the model's {n} layers")
    with parameters_on_meta():  # buffers are computed on CPU by the model's own constructors
        hf = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype])
    parts = StagePaths.of(hf)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    layers = _get(hf, parts.layers)
    for i in range(n):
        if not a <= i < b:
            layers[i] = nn.Module()  # placeholder keeps the original index of every owned layer
    if not spec.has_embed:
        for p in parts.embed:
            _set(hf, p, None)
    if not spec.has_tail:
        _set(hf, parts.norm, None)
        _set(hf, parts.lm_head, None)
    _materialise_parameters(hf)
    if tied and spec.has_embed and spec.has_tail:
        _get(hf, parts.lm_head).weight = _get(hf, parts.token).weight
    stage = Stage(hf, cfg, spec, parts)
    stage.seed = seed
    stage.autocast = DTYPES[autocast] if autocast else None
    source = weights if weights is not None else (None if is_preset(model) or random_weights else resolve_model(model))
    if source is None:
        _init_stage(stage, seed, float(getattr(cfg, "initializer_range", 0.02)))
    else:
        load_stage_weights(stage, source)
    hf.train()
    return stage


@contextlib.contextmanager
def parameters_on_meta():
    """Construct modules with every parameter on the meta device and every buffer for real.

    Buffers (rotary frequencies, Gemma's ``embed_scale``, anything a constructor computes) are
    small and only their constructor knows their values, so they are kept as built; parameters
    are large and are filled later from the checkpoint or the seeded init."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _materialise_parameters(model: nn.Module) -> None:
    """Give every meta parameter CPU storage (uninitialised), keeping shared parameters shared."""
    made: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            m._parameters[name] = made[id(p)]


@torch.no_grad()
def _init_stage(stage: Stage, seed: int, std: float) -> None:
    names = [n for n, _ in stage.named_parameters()]
    plain = [n for n in names if stage.source_name(n) == n]
    init_parameters(stage.module, seed, std, names=plain)
    for n in names:
        src = stage.source_name(n)
        if src != n:  # a tied copy: initialise it as the parameter it copies
            holder = _holder(src, dict(stage.named_parameters())[n])
            init_parameters(holder, seed, std, names=[src])


def _holder(name: str, param: nn.Parameter) -> nn.Module:
    """A module tree in which ``param`` is reachable under ``name``."""
    root = nn.Module()
    m = root
    *path, leaf = name.split(".")
    for part in path:
        child = nn.Module()
        setattr(m, part, child)
        m = child
    setattr(m, leaf, param)
    return root


# ----------------------------------------------------------------------------- loading tensors by name
def safetensors_index(directory: str | Path) -> dict[str, Path]:
    """name -> file of a HF checkpoint directory: a sharded index or a single file, safetensors
    preferred, else ``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``)."""
    d = Path(directory)
    for idx in (d / "model.safetensors.index.json", d / "pytorch_model.bin.index.json"):
        if idx.is_file():
            wm = json.loads(idx.read_text()).get("weight_map")
            if not isinstance(wm, dict):
                raise ModelSpecError(f"{idx}: field 'weight_map': expected an object name -> file")
            for k, v in wm.items():  # nothing outside the model directory is ever read
                if not isinstance(v, str) or not v or "\0" in v or Path(v).is_absolute() or ".." in Path(v).parts:
                    raise ModelSpecError(f"{idx}: field 'weight_map.{k}': expected a file inside {d}, got {v!r}")
            return {k: d / v for k, v in wm.items()}
    single = d / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    if (d / "pytorch_model.bin").is_file():
        return {k: d / "pytorch_model.bin" for k in _bin_tensors(d / "pytorch_model.bin")}
    raise ModelSpecError(f"{d}: expected model.safetensors, pytorch_model.bin or their .index.json")


def _bin_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, memory-mapped; ``weights_only`` refuses pickled code."""
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a corrupt file or one holding more than tensors
        raise ModelSpecError(f"{path}: cannot be read as a weights-only state dict ({str(e).splitlines()[0][:200]})") \
            from None
    if not isinstance(sd, dict):
        raise ModelSpecError(f"{path}: expected a state dict (name -> tensor), got {type(sd).__name__}")
    return sd


def read_tensors(directory: str | Path, names: list[str], aliases: dict[str, str] | None = None, *,
                 index: dict[str, Path] | None = None, missing_ok: bool = False) -> dict[str, torch.Tensor]:
    """Read only ``names`` (falling back to ``aliases[name]``) from a safetensors checkpoint whose
    name -> file map is ``index`` (default: the directory's, :func:`safetensors_index`); a name
    it lacks is an error, or left out with ``missing_ok``."""
    from safetensors import safe_open

    index = safetensors_index(directory) if index is None else index
    aliases = aliases or {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for n in names:
        key = n if n in index else aliases.get(n)
        if key is None or key not in index:
            if missing_ok:
                continue
            raise ModelSpecError(f"{directory}: tensor {n!r} is missing from the checkpoint")
        by_file.setdefault(index[key], []).append((n, key))
    out: dict[str, torch.Tensor] = {}
    for path, pairs in by_file.items():
        if not path.is_file():
            raise ModelSpecError(f"{path}: file named by the checkpoint index does not exist")
        if path.suffix == ".bin":
            sd = _bin_tensors(path)
            out.update({n: sd[key] for n, key in pairs})
            continue
        with safe_open(str(path), framework="pt") as f:
            for n, key in pairs:
                out[n] = f.get_tensor(key)
    return out


def _converted_tensors(stage: Stage, directory: str | Path, names: list[str],
                       aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The stage's tensors as HF's own loader produces them (its checkpoint key conversions:
    renames, per-expert tensors merged). Loads the whole model once, on CPU, then keeps the
    stage's part."""
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(str(directory), config=stage.cfg, dtype=stage.dtype,
                                                 local_files_only=True)
    state = dict(whole.named_parameters(remove_duplicate=False))
    out = {}
    for n in names:
        key = n if n in state else aliases.get(n)
        if key not in state:
            raise ModelSpecError(f"{directory}: tensor {n!r} is missing from the checkpoint")
        out[n] = state[key].detach()
    return out


@torch.no_grad()
def load_stage_weights(stage: Stage, directory: str | Path) -> None:
    params = dict(stage.named_parameters())
    aliases = {n: stage.source_name(n) for n in params if stage.source_name(n) != n}
    index = safetensors_index(directory)
    if all(n in index or aliases.get(n) in index for n in params):
        tensors = read_tensors(directory, list(params), aliases)
    else:  # saved under HF's on-disk names (MoE experts per file, GPT-NeoX's embed_out): HF converts them
        tensors = _converted_tensors(stage, directory, list(params), aliases)
    for n, p in params.items():
        t = tensors[n]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelSpecError(f"{directory}: tensor {n!r}: expected shape {tuple(p.shape)}, got {tuple(t.shape)}")
        p.copy_(t.to(p.dtype))


# ----------------------------------------------------------------------------- several chunks on one rank
class StageSet:
    """The chunks one rank holds (interleaved or V placement), each a :class:`Stage`.

    Parameters are listed once: in the V placement the rank holding the embedding chunk and
    the tail chunk shares ONE tied weight (the lm_head uses the embedding's parameter), which
    belongs to the embedding chunk (the first in pipeline order) for the optimizer, the group
    all-reduce and the checkpoint. Names stay the HF names."""

    def __init__(self, chunks: dict[int, Stage]):
        self.chunks = dict(sorted(chunks.items()))
        first = next(iter(self.chunks.values()))
        self.cfg = first.cfg
        seen: set[int] = set()
        self._owned: dict[int, list[tuple[str, nn.Parameter]]] = {}
        for c, st in self.chunks.items():
            self._owned[c] = [(n, p) for n, p in st.named_parameters() if id(p) not in seen]
            seen |= {id(p) for _, p in self._owned[c]}

    def owned(self, chunk: int) -> list[tuple[str, nn.Parameter]]:
        """``chunk``'s parameters not already listed by an earlier chunk of this rank."""
        return self._owned[chunk]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for c in self.chunks:
            yield from self._owned[c]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def source_name(self, name: str) -> str:
        for st in self.chunks.values():
            src = st.source_name(name)
            if src != name:
                return src
        return name

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.chunks.values())).dtype

    @property
    def hidden_size(self) -> int:
        return next(iter(self.chunks.values())).hidden_size

    def set_profiler(self, profiler: "BlockObserver | None") -> None:
        for st in self.chunks.values():
            st.profiler = profiler

    def only(self) -> "Stage":
        """The one chunk of a rank that holds one (what evaluation and single-chunk tools take)."""
        if len(self.chunks) != 1:
            raise ValueError(f"this rank holds chunks {list(self.chunks)}; expected one")
        return next(iter(self.chunks.values()))

    def tied_copy_parameter(self) -> nn.Parameter | None:
        """The tail chunk's copy of a tied weight that another rank also holds (synced by the tied
        all-reduce, so counted once across ranks by whoever counts the embedding); None when this rank
        holds no such copy, e.g. in the V placement where both ends share one parameter."""
        if self.shares_tied_weight():
            return None
        for st in self.chunks.values():
            if st.tied_copy:
                return st.tied_parameter()
        return None

    def shares_tied_weight(self) -> bool:
        """True when this rank holds the embedding and the tail chunk and they use one tied weight."""
        st = list(self.chunks.values())
        emb = [s for s in st if s.spec.has_embed]
        tail = [s for s in st if s.spec.has_tail]
        if not (emb and tail) or not getattr(self.cfg, "tie_word_embeddings", False):
            return False
        return _get(tail[0].module, tail[0].parts.lm_head).weight is _get(emb[0].module, emb[0].parts.token).weight


def build_stages(model: str, cfg, specs: dict[int, StageSpec], *, seed: int = 0, dtype: str = "float32",
                 weights: str | Path | None = None, autocast: str = "") -> StageSet:
    """One :class:`Stage` per chunk of a rank; a tail chunk of a tied model whose rank also holds the
    embedding chunk uses the embedding's weight (the copy it was built with is dropped)."""
    chunks = {c: build_stage(model, cfg, spec, seed=seed, dtype=dtype, weights=weights, autocast=autocast)
              for c, spec in specs.items()}
    emb = [st for st in chunks.values() if st.spec.has_embed]
    if emb and getattr(cfg, "tie_word_embeddings", False):
        shared = _get(emb[0].module, emb[0].parts.token).weight
        for st in chunks.values():
            if st.spec.has_tail and not st.spec.has_embed:
                _get(st.module, st.parts.lm_head).weight = shared
    return StageSet(chunks)


# ----------------------------------------------------------------------------- split backward (zero-bubble)
@dataclass(eq=False)
class WeightTask:
    """What the weight-gradient pass of one micro-batch needs, kept from its input-gradient pass:
    either the whole backward (a chunk without an input gradient: it all waits for W), or the
    linear layers' calls whose weight gradients were set aside (:mod:`torchpp.models.deferred`)."""

    full: tuple[torch.Tensor, torch.Tensor | None] | None = None
    kept: list[Deferred] | None = None


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   weights: list[nn.Parameter], now: list[nn.Parameter]) -> tuple[torch.Tensor | None, WeightTask]:
    """The input gradient of one chunk's micro-batch (``I``), keeping what ``backward_weight`` needs.

    The weight gradients of the stage's patched linear layers (:meth:`Stage.defer_weight_gradients`)
    wait for ``W``; every other gradient of ``weights`` (norms, layers not patched) and those of
    ``now`` (layers recomputed from a checkpoint: their saved tensors are rebuilt for this pass only)
    are taken here, in the same autograd call. A chunk whose input needs no gradient (the embedding
    chunk) computes nothing now: the whole backward runs in W. The graph is freed on return."""
    if x is None or not x.requires_grad:
        return None, WeightTask(full=(out, grad))
    wanted = [*now, *(w for w in weights if all(w is not p for p in now))]
    gout = torch.ones_like(out) if grad is None else grad
    with collecting(now) as kept:
        res = torch.autograd.grad(out, [x, *wanted], gout, allow_unused=True)
    _accumulate(wanted, res[1:])
    return res[0], WeightTask(kept=kept)


def backward_weight(task: WeightTask) -> None:
    """The weight gradients of one micro-batch (``W``), accumulated into ``.grad``; what the input
    pass kept is released when ``task`` is dropped."""
    if task.full is not None:
        out, grad = task.full
        torch.autograd.backward(out, grad)
        task.full = None
        return
    with torch.no_grad():
        for d in task.kept or ():
            d.compute()
    task.kept = None


def _accumulate(params: list[nn.Parameter], grads) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            add_grad(p, g.detach())
