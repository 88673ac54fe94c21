"""Model presets built from config (random init, fixed seed) and local HF checkpoints.

Weights are initialised per parameter from a generator seeded by (seed, parameter name), so a
rank that materialises only its stage gets exactly the tensors the whole model would have.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..formats import ModelInfo

if TYPE_CHECKING:  # torch and transformers are imported where used: reading a preset's name costs neither
    import torch
    from transformers import PretrainedConfig

# Real Qwen3-0.6B dimensions (28 layers, tied embeddings, 151,936-token vocabulary).
_QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attention_dropout=0.0)
_QWEN3_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
# Benchmark size used for pipeline comparisons (Qwen3 architecture, hidden 256, 8 layers).
_QWEN3_SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
# The homelab scenario's model (configs/cluster/homelab.json): Qwen3 architecture, 16 layers of hidden 384,
# a 16k vocabulary with untied embeddings (as Qwen3 from 1.7B up), ~41M parameters. With AdamW it needs
# ~0.65 GB for weights, gradients and moments alone: more than any one host of homelab may use, less than
# all of them together. Sixteen thin layers rather than eight wide ones let a plan follow the hosts'
# uneven speeds layer by layer. One step of 32 x 32 tokens is ~0.2 TFLOP: a few seconds on 1.85 cores.
_QWEN3_HOMELAB = dict(vocab_size=16384, hidden_size=384, intermediate_size=1152, num_hidden_layers=16,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
_LLAMA_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)
_GPT2_TINY = dict(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=2048,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=0)

# preset -> (transformers config class name, its arguments)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3Config", _QWEN3_06B),
    "qwen3-small": ("Qwen3Config", _QWEN3_SMALL),
    "qwen3-homelab": ("Qwen3Config", _QWEN3_HOMELAB),
    "qwen3-tiny": ("Qwen3Config", _QWEN3_TINY),
    "llama-tiny": ("LlamaConfig", _LLAMA_TINY),
    "gpt2-tiny": ("GPT2Config", _GPT2_TINY),
}
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_MODEL_TYPES = {"Qwen3Config": "qwen3", "LlamaConfig": "llama", "GPT2Config": "gpt2"}
"""Each preset's config class -> its ``model_type`` (what :func:`preset_info` writes as the architecture)."""


def torch_dtypes() -> dict[str, "torch.dtype"]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


def __getattr__(name: str) -> Any:
    """``presets.DTYPES`` (name -> torch dtype) is built on first use, so importing presets imports no torch."""
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ModelSpecError(ValueError):
    pass


def is_preset(name: str) -> bool:
    return name in PRESETS


ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def resolve_model(model: str) -> str:
    """A preset name or a local directory as given; a hub id (``org/name``) that is not a local
    directory becomes its snapshot in the local HF cache (never downloaded)."""
    if model in PRESETS or Path(model).is_dir() or model.count("/") != 1 or model.startswith((".", "/")):
        return model
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, local_files_only=True)
    except Exception:  # not in the cache (LocalEntryNotFoundError) or a malformed id (HFValidationError)
        return model  # load_config names it as neither a preset nor a directory


def load_config(model: str, num_layers: int | None = None, attn_implementation: str | None = None) -> PretrainedConfig:
    """Config of a preset name or a local HF checkpoint directory (never downloads).

    Raises :class:`ModelSpecError` naming the feature when torchpp cannot train the model
    exactly as HF does, so ``plan``, ``profile`` and ``train`` all refuse it up front."""
    if model in PRESETS:
        import transformers

        cls, kw = PRESETS[model]
        cfg = getattr(transformers, cls)(**kw)
    else:
        p = Path(resolve_model(model))
        if not (p.is_dir() and (p / "config.json").is_file()):
            raise ModelSpecError(f"--model: {model!r} is neither a preset ({', '.join(PRESETS)}), a local "
                                 "checkpoint directory with config.json, nor a hub id in the local HF cache")
        refuse_remote_code(p)
        check_config_sizes(p / "config.json")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 (transformers' own validation: one line naming the file)
            raise ModelSpecError(f"{p / 'config.json'}: transformers refuses it: "
                                 f"{(str(e).strip().splitlines() or [type(e).__name__])[-1].strip()}") from None
    cfg._attn_implementation = choose_attn_implementation(cfg, attn_implementation)
    if num_layers is not None:
        total = num_hidden_layers(cfg)
        if not 1 <= num_layers <= total:
            raise ModelSpecError(f"--layers: expected 1..{total} for {model}, got {num_layers}")
        set_num_hidden_layers(cfg, num_layers)
    check_supported(cfg, model)
    return cfg


def _causal_lm_class(cfg: PretrainedConfig) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError:
        raise ModelSpecError(f"model_type {getattr(cfg, 'model_type', '?')!r}: torchpp does not support it "
                             "(no AutoModelForCausalLM class for its config)") from None


def choose_attn_implementation(cfg: PretrainedConfig, requested: str | None = None) -> str:
    """``requested`` if given, else SDPA where the model class supports it and eager where HF
    requires it (Gemma2, Bloom: attention soft-capping or biases SDPA cannot express)."""
    if requested is not None:
        if requested not in ATTN_IMPLEMENTATIONS:
            raise ModelSpecError(f"attention implementation: expected one of {', '.join(ATTN_IMPLEMENTATIONS)}, "
                                 f"got {requested!r}")
        return requested
    if getattr(cfg, "model_type", "") == "gpt2":
        return "eager"
    return "sdpa" if getattr(_causal_lm_class(cfg), "_supports_sdpa", False) else "eager"


def check_supported(cfg: PretrainedConfig, model: str = "") -> None:
    """Raise :class:`ModelSpecError` with one line naming what torchpp cannot run exactly."""
    key = f"{cfg._attn_implementation}:{cfg.to_json_string(use_diff=False)}"
    if key not in _CHECKED:
        _CHECKED[key] = _unsupported(cfg)
    if _CHECKED[key] is not None:
        raise ModelSpecError(f"{model or type(cfg).__name__}: torchpp does not support {_CHECKED[key]}")


_CHECKED: dict[str, str | None] = {}


def _unsupported(cfg: PretrainedConfig) -> str | None:
    """Build the model on the meta device (no memory) and look at what a stage would run."""
    import torch

    from .blocks import UnsupportedModelError, find_parts
    from .semantics import unsupported_feature

    try:
        with torch.device("meta"):
            m = _causal_lm_class(cfg)(cfg)
        parts = find_parts(m)
    except UnsupportedModelError as e:
        return f"its module layout ({e})"
    except (ValueError, TypeError) as e:
        return f"this configuration ({str(e).splitlines()[0]})"
    return unsupported_feature(cfg, m, parts)


def _read_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelSpecError(f"{path}: expected a JSON object: {e}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def refuse_remote_code(model_dir: Path) -> None:
    """Raise :class:`ModelSpecError` for a directory that would need its own Python code.

    transformers runs a checkpoint's ``.py`` files when its config or tokenizer config has an
    ``auto_map`` (and asks on the terminal first); torchpp never does either. A ``model_type``
    transformers does not know could only be built from such code, so it is refused too."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    why = "torchpp never runs a model directory's own code"
    cfg_path = model_dir / "config.json"
    conf = _read_object(cfg_path)
    if "auto_map" in conf:
        raise ModelSpecError(f"{cfg_path}: refused: 'auto_map' names the directory's own Python code; {why}")
    model_type = conf.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ModelSpecError(f"{cfg_path}: refused: model_type {model_type!r} is not an architecture this "
                             f"transformers knows; {why}")
    tok_path = model_dir / "tokenizer_config.json"
    if tok_path.is_file() and "auto_map" in _read_object(tok_path):
        raise ModelSpecError(f"{tok_path}: refused: 'auto_map' names the directory's own Python code; {why}")


CONFIG_SIZES = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "vocab_size", "num_attention_heads",
                "n_head", "num_key_value_heads", "intermediate_size", "head_dim")
"""A config's sizes: each, where present, a positive integer (``num_hidden_layers: -1`` reached
transformers' validators as a 20-line traceback)."""


def check_config_sizes(cfg_path: Path) -> None:
    """Raise :class:`ModelSpecError` naming the file and field of a size that is no positive integer."""
    from ..validate import MAX_LAYERS

    conf = _read_object(cfg_path)
    for key in CONFIG_SIZES:
        v = conf.get(key)
        if key in conf and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1
                                               or (key in ("num_hidden_layers", "n_layer") and v > MAX_LAYERS)):
            most = MAX_LAYERS if key in ("num_hidden_layers", "n_layer") else None
            raise ModelSpecError(f"{cfg_path}: field '{key}': expected an integer >= 1"
                                 f"{f' and <= {most}' if most else ''}, got {v!r}")


def num_hidden_layers(cfg: PretrainedConfig) -> int:
    return int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer"))


def set_num_hidden_layers(cfg: PretrainedConfig, n: int) -> None:
    if getattr(cfg, "model_type", "") == "gpt2":
        cfg.n_layer = n
    else:
        cfg.num_hidden_layers = n
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:n]


def hidden_size(cfg: PretrainedConfig) -> int:
    return int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd"))


def precision_fields(dtype: str) -> dict[str, str]:
    """``--dtype`` of profile and plan -> the model fields: bfloat16 is mixed precision on CPU
    (fp32 master weights and optimizer state, bf16 autocast); other names are the weights' dtype."""
    return {"dtype": "float32", "autocast": "bfloat16"} if dtype == "bfloat16" else {"dtype": dtype, "autocast": ""}


def model_info(cfg: PretrainedConfig, model: str, dtype: str = "float32", autocast: str = "") -> ModelInfo:
    """What files say of ``model``: a local directory's absolute path and config hash included."""
    local = model not in PRESETS and Path(resolve_model(model)).is_dir()
    where = Path(resolve_model(model)).resolve() if local else None
    return ModelInfo(name=model if model in PRESETS else Path(model).name, source="preset" if model in PRESETS else "path",
                     num_layers=num_hidden_layers(cfg), hidden_size=hidden_size(cfg), vocab_size=int(cfg.vocab_size),
                     tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), dtype=dtype,
                     architecture=str(getattr(cfg, "model_type", "")), autocast=autocast,
                     path=str(where) if where else "", config_hash=config_hash(where) if where else "")


def preset_info(model: str, num_layers: int | None = None, dtype: str = "float32", autocast: str = "") -> ModelInfo:
    """:func:`model_info` of a preset, read off its table: a command that only writes a plan
    (``torchpp plan --strategy``, ``calibrate-memory``'s checks) imports neither transformers nor
    torch for it (seconds of CPU on a small host; presets are all supported, so nothing is checked
    that a built model would tell)."""
    cls, kw = PRESETS[model]
    total = int(kw.get("num_hidden_layers") or kw["n_layer"])
    if num_layers is not None and not 1 <= num_layers <= total:
        raise ModelSpecError(f"--layers: expected 1..{total} for {model}, got {num_layers}")
    return ModelInfo(name=model, source="preset", num_layers=total if num_layers is None else num_layers,
                     hidden_size=int(kw.get("hidden_size") or kw["n_embd"]), vocab_size=int(kw["vocab_size"]),
                     tied_embeddings=bool(kw["tie_word_embeddings"]), dtype=dtype, architecture=_MODEL_TYPES[cls],
                     autocast=autocast)


CONFIG_HASH_IGNORED = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")
"""config.json keys that say how or where a model was saved, not which model it is."""


def config_hash(directory: str | Path) -> str:
    """``sha256:`` of a checkpoint directory's config.json settings (sorted keys, without
    ``CONFIG_HASH_IGNORED``): equal for the same model saved again, or copied elsewhere."""
    data = _read_object(Path(directory) / "config.json")
    kept = {k: v for k, v in data.items() if k not in CONFIG_HASH_IGNORED}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_parameters(model: torch.nn.Module, seed: int, std: float, names: Iterable[str] | None = None) -> None:
    """Deterministic per-name init: norms one, biases zero, everything else N(0, std)."""
    import torch

    with torch.no_grad():
        _init_parameters(model, seed, std, names)


def _init_parameters(model: torch.nn.Module, seed: int, std: float, names: Iterable[str] | None) -> None:
    import torch

    wanted = set(names) if names is not None else None
    for name, p in model.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            g = torch.Generator().manual_seed(_param_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)


def has_weights(model: str) -> bool:
    """A preset (seeded weights), or a local directory holding weight files, not config.json alone."""
    if model in PRESETS:
        return True
    d = Path(resolve_model(model))
    return any(any(d.glob(pattern)) for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json"))


def build_model(model: str, *, seed: int = 0, dtype: str = "float32", num_layers: int | None = None,
                config: PretrainedConfig | None = None, random_weights: bool = False) -> torch.nn.Module:
    """The whole causal LM: a preset with seeded init, or a local checkpoint's weights
    (``random_weights``: seeded init from the config whatever the model, as timings need)."""
    from transformers import AutoModelForCausalLM

    DTYPES = torch_dtypes()
    if dtype not in DTYPES:
        raise ModelSpecError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = config or load_config(model, num_layers)
    if model in PRESETS or random_weights:
        m = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype])
        init_parameters(m, seed, float(getattr(cfg, "initializer_range", 0.02)))
        if getattr(cfg, "tie_word_embeddings", False):
            m.tie_weights()
    else:
        import pickle

        try:
            m = AutoModelForCausalLM.from_pretrained(resolve_model(model), config=cfg, dtype=DTYPES[dtype],
                                                     local_files_only=True, trust_remote_code=False)
        except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as e:  # pickled weights refused: one line
            first = ("torch.load(weights_only=True) refused a pickle" if isinstance(e, pickle.UnpicklingError)
                     else (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise ModelSpecError(f"{resolve_model(model)}: its weights cannot be read as weights-only tensors "
                                 f"({first[:200]}); torchpp never unpickles code") from None
    m.train()
    return m
