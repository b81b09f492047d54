"""One decoding step of a GPT-style decoder (DiviML's GPT-3 case study), in two forms:

- ``gpt-small-decode`` (:func:`gpt_small_decode`): a real PyTorch model at small sizes, captured and run like
  any other model. Its attention heads and its MLP's hidden units are cut into ``groups`` slices with weights
  of their own, as tensor-parallel serving cuts them (Megatron-LM), so the slices are branches a mapping can
  put on different devices; the slices' outputs are summed into the residual stream.
- ``gpt3-decode`` (:func:`gpt3_decode`): the same graph of units at GPT-3 175B's sizes (96 layers,
  d_model 12288, 96 heads, 4 x d_model MLP, vocabulary 50257, fp16), with the FLOPs, bytes and weight bytes of
  each unit worked out from the architecture, for mapping on simulated devices (no tensors are made: 350 GB).

A step reads, per input, one new token and the keys and values of ``context`` earlier tokens (DiviML: 20 tokens
an input), and returns the next token's logits. Units of layer i: ``l{i}.attn{g}`` (layer norm, the q/k/v
projections of the heads of slice g, attention over the cache and the new token, and the slice's rows of the
output projection), ``l{i}.attn_sum`` (the slices' sum added to the residual), ``l{i}.mlp{g}`` (layer norm,
the slice of the first projection, GELU, the slice of the second), ``l{i}.mlp_sum``; then ``head`` (final layer
norm and the logits). Every layer's sums are cut units, so MILP-SPLIT sees one module per half layer.

>>> g = gpt3_decode(batch=1)
>>> len(g), round(sum(n.param_bytes for n in g.nodes) / 1e9)
(962, 350)
>>> g.nodes[1].name, g.nodes[1].kind, g.nodes[1].dtype
('l0.attn0', 'linear', 'float16')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from opsched.graph.ir import Graph, Node


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    d_model: int
    heads: int
    vocab: int
    context: int = 20
    groups: int = 4
    ffn_factor: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_factor * self.d_model


GPT3 = GPTConfig(layers=96, d_model=12288, heads=96, vocab=50257)
SMALL = GPTConfig(layers=4, d_model=256, heads=8, vocab=2048, groups=2)


def gpt3_decode(batch: int = 1, config: GPTConfig = GPT3, dtype: str = "float16") -> Graph:
    """The units of one decoding step of ``config`` at ``batch`` inputs (see the module docstring)."""
    size = 2 if dtype in ("float16", "bfloat16") else 4
    c = config
    d, g = c.d_model, c.groups
    token = batch * d * size                       # one value of the residual stream
    nodes = [Node("embed", kind="embedding", args=("tokens",), shape=(batch, d), dtype=dtype,
                  bytes_read=token, bytes_written=token, param_bytes=(c.vocab + c.context + 1) * d * size)]
    x = "embed"
    for i in range(c.layers):
        heads = c.heads // g
        width = heads * c.head_dim
        cache = 2 * batch * c.context * width * size  # the slice's keys and values of earlier tokens
        attention = 2 * 2 * batch * heads * (c.context + 1) * c.head_dim
        params = (3 * d * width + width * d) * size
        slices = []
        for k in range(g):
            name = f"l{i}.attn{k}"
            nodes.append(Node(name, kind="linear", args=(x,), shape=(batch, d), dtype=dtype,
                              flops=2.0 * batch * (3 * d * width + width * d) + attention,
                              bytes_read=token + cache + params, bytes_written=token, param_bytes=params,
                              attrs={"op": "attention_slice", "heads": heads}, ops=("layer_norm", "linear",
                                                                                   "attention", "linear")))
            slices.append(name)
        x = _sum(nodes, f"l{i}.attn_sum", slices, x, batch, d, dtype, size)
        hidden = c.ffn // g
        params = 2 * d * hidden * size
        slices = []
        for k in range(g):
            name = f"l{i}.mlp{k}"
            nodes.append(Node(name, kind="linear", args=(x,), shape=(batch, d), dtype=dtype,
                              flops=2.0 * batch * 2 * d * hidden, bytes_read=token + params, bytes_written=token,
                              param_bytes=params, attrs={"op": "mlp_slice"},
                              ops=("layer_norm", "linear", "gelu", "linear")))
            slices.append(name)
        x = _sum(nodes, f"l{i}.mlp_sum", slices, x, batch, d, dtype, size)
    params = c.vocab * d * size
    nodes.append(Node("head", kind="linear", args=(x,), shape=(batch, c.vocab), dtype=dtype,
                      flops=2.0 * batch * d * c.vocab, bytes_read=token + params,
                      bytes_written=batch * c.vocab * size, param_bytes=params, ops=("layer_norm", "linear")))
    return Graph(nodes, inputs=["tokens"], outputs=["head"], name=f"gpt-decode-{c.layers}x{d}")


def _sum(nodes: list[Node], name: str, slices: list[str], residual: str, batch: int, d: int, dtype: str,
         size: int) -> str:
    token = batch * d * size
    nodes.append(Node(name, kind="elementwise", args=(*slices, residual), shape=(batch, d), dtype=dtype,
                      flops=float(len(slices) * batch * d), bytes_read=(len(slices) + 1) * token,
                      bytes_written=token, ops=("add",) * len(slices)))
    return name


class DecodeStep(nn.Module):
    """One decoding step: ``forward(tokens, cache) -> logits`` with ``tokens`` (B,) token ids and ``cache``
    (B, layers, 2, heads, context, head_dim) the keys and values of the earlier tokens (batch first, as
    ``--batch`` rescales every example input's first dimension)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab, c.d_model)
        self.position = nn.Parameter(torch.randn(c.d_model) * 0.02)  # the new token's position, context + 1
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position
        for i, layer in enumerate(self.layers):
            x = layer(x, cache[:, i])
        return self.head(self.norm(x))


class Layer(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.attention = nn.ModuleList(AttentionSlice(c) for _ in range(c.groups))
        self.mlp = nn.ModuleList(MLPSlice(c) for _ in range(c.groups))

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        per = cache.shape[2] // len(self.attention)  # the heads of each slice
        x = x + sum(s(x, cache[:, :, k * per:(k + 1) * per]) for k, s in enumerate(self.attention))
        return x + sum(s(x) for s in self.mlp)


class AttentionSlice(nn.Module):
    """The heads of one slice: their q/k/v projections, attention over the cache and the new token, and
    their rows of the output projection (a partial sum of the attention output)."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads // c.groups
        self.head_dim = c.head_dim
        width = self.heads * c.head_dim
        self.norm = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * width)
        self.out = nn.Linear(width, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).view(batch, 3, self.heads, 1, self.head_dim).unbind(1)
        keys = torch.cat([cache[:, 0], k], dim=2)        # (B, heads, context + 1, head_dim)
        values = torch.cat([cache[:, 1], v], dim=2)
        scores = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return self.out((scores @ values).reshape(batch, self.heads * self.head_dim))


class MLPSlice(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(c.d_model)
        self.up = nn.Linear(c.d_model, c.ffn // c.groups)
        self.down = nn.Linear(c.ffn // c.groups, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(self.norm(x))))


def gpt_small_decode(batch: int = 1, image_size: int | None = None, config: GPTConfig = SMALL
                     ) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The zoo's ``gpt-small-decode``: a seeded :class:`DecodeStep` and example inputs (``image_size`` is
    not used: the model reads tokens).

    >>> model, (tokens, cache) = gpt_small_decode(batch=2)
    >>> tuple(model(tokens, cache).shape), tuple(cache.shape)
    ((2, 2048), (2, 4, 2, 8, 20, 32))
    """
    c = config
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = DecodeStep(c).eval()
    tokens = torch.randint(0, c.vocab, (batch,), generator=generator)
    cache = torch.randn(batch, c.layers, 2, c.heads, c.context, c.head_dim, generator=generator)
    return model, (tokens, cache)
