"""Real fine-tuning of all-MiniLM-L6-v2, for the delta benchmarks.

The delta figures come from the real MiniLM weights fine-tuned with AdamW
(lr 2e-5); ``bench_delta.minilm_states`` moves the same weights with
synthetic gradients instead, which touch every parameter every step. A real
run differs where it matters for deltas: a step's gradient reaches only the
embedding rows of the tokens in its batch (more than half of MiniLM's
weights are the 30,522 x 384 word embeddings), and Adam's update follows
real gradient statistics.

This is the model as sentence-transformers trains it, in plain torch: the
BERT encoder of the package's ``model.safetensors`` (6 layers, 384 wide, 12
heads, GELU, dropout 0.1 while training), mean pooling over the tokens, and
the MultipleNegativesRankingLoss of sentence-transformers (cosine
similarity x 20, each anchor's positive against the batch's other
positives), with AdamW (lr 2e-5, weight decay 0.01: sentence-transformers'
defaults). The tokenizer is the package's ``tokenizer.json``, read by the
``tokenizers`` library. The text: pairs of consecutive sentences of the
model's own README and this repository's documentation (English prose; a
sentence and the next one are the positive pair, as in the "sentence
continuation" pairs of the model's training data).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from _data import minilm_path, minilm_state
from _report import REPO

State = dict[str, torch.Tensor]

HIDDEN, HEADS, LAYERS, EPS = 384, 12, 6, 1e-12
DROPOUT = 0.1


def sentence_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """(sentence, next sentence) pairs from the model's README and docs/*.md, shuffled."""
    texts = [
        minilm_path().parent / "README.md",
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
    ]
    pairs = []
    for path in texts:
        prose = re.sub(r"```.*?```", " ", Path(path).read_text(), flags=re.S)
        prose = re.sub(r"[|#*`>\[\]()_]", " ", prose)
        sentences = [
            " ".join(s.split())
            for s in re.split(r"(?<=[.!?])\s+", prose)
            if 30 <= len(" ".join(s.split())) <= 300
        ]
        pairs += list(itertools.pairwise(sentences))
    random.Random(seed).shuffle(pairs)
    return pairs


class MiniLM:
    """The encoder over a flat state dict of its weights (the checkpoint's keys)."""

    def __init__(self, weights: State) -> None:
        self.params = {k: torch.nn.Parameter(v.float().clone()) for k, v in weights.items()}

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        p = self.params
        return F.layer_norm(x, (HIDDEN,), p[f"{name}.weight"], p[f"{name}.bias"], EPS)

    def _dense(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.params[f"{name}.weight"], self.params[f"{name}.bias"])

    def embed(self, ids: torch.Tensor, mask: torch.Tensor, train: bool) -> torch.Tensor:
        """Mean-pooled sentence embeddings of a batch of token ids."""
        p, (b, n) = self.params, ids.shape
        x = (
            F.embedding(ids, p["embeddings.word_embeddings.weight"])
            + p["embeddings.position_embeddings.weight"][:n]
            + p["embeddings.token_type_embeddings.weight"][0]
        )
        x = F.dropout(self._ln(x, "embeddings.LayerNorm"), DROPOUT, train)
        keep = mask[:, None, None, :].bool()  # attend to real tokens only
        for i in range(LAYERS):
            pre = f"encoder.layer.{i}"
            q, k, v = (
                self._dense(x, f"{pre}.attention.self.{w}")
                .view(b, n, HEADS, HIDDEN // HEADS)
                .transpose(1, 2)
                for w in ("query", "key", "value")
            )
            a = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=DROPOUT if train else 0.0
            )
            a = a.transpose(1, 2).reshape(b, n, HIDDEN)
            a = F.dropout(self._dense(a, f"{pre}.attention.output.dense"), DROPOUT, train)
            x = self._ln(x + a, f"{pre}.attention.output.LayerNorm")
            h = F.gelu(self._dense(x, f"{pre}.intermediate.dense"))
            h = F.dropout(self._dense(h, f"{pre}.output.dense"), DROPOUT, train)
            x = self._ln(x + h, f"{pre}.output.LayerNorm")
        m = mask[..., None].to(x.dtype)
        return (x * m).sum(1) / m.sum(1).clamp(min=1.0)


def finetune_states(
    steps: int,
    batch: int = 16,
    max_tokens: int = 64,
    seed: int = 0,
    losses: list[float] | None = None,
) -> Iterator[State]:
    """The MiniLM weights (fp32) before training and after each of ``steps`` real
    fine-tuning steps (see the module docstring); ``batch`` sentence pairs per step.
    Each step's training loss is appended to ``losses`` when given."""
    from tokenizers import Tokenizer

    torch.manual_seed(seed)
    tok = Tokenizer.from_file(str(minilm_path().parent / "tokenizer.json"))
    tok.enable_truncation(max_tokens)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    pairs = sentence_pairs(seed)
    model = MiniLM(minilm_state())
    params = list(model.params.values())
    optim = torch.optim.AdamW(params, lr=2e-5, weight_decay=0.01)

    def batch_of(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = tok.encode_batch(texts)
        return (torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc]))

    yield {k: p.detach().clone() for k, p in model.params.items()}
    for step in range(steps):
        start = step * batch % max(1, len(pairs) - batch)
        chunk = pairs[start : start + batch]
        a = model.embed(*batch_of([x for x, _ in chunk]), train=True)
        b = model.embed(*batch_of([y for _, y in chunk]), train=True)
        scores = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T * 20.0
        loss = F.cross_entropy(scores, torch.arange(len(chunk)))
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"MiniLM fine-tuning diverged at step {step}")
        if losses is not None:
            losses.append(loss.item())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        yield {k: p.detach().clone() for k, p in model.params.items()}
