"""Where each of our parameters comes from in a checkpoint, and how its layout changes.

A family module answers, for each parameter path of its model and each checkpoint naming
("hf": Hugging Face safetensors; "gguf": llama.cpp; "jaxserve": our orbax layout), a
``TensorSource``: the tensor's name(s) in that checkpoint and a ``Layout``, the reshape that
turns the stored tensor into our parameter. The layout is data, not a function, so a sharded
loader can also map a slice of our parameter back to the slice of the stored tensor it needs.

Layouts (torch stores a Linear weight ``[out, in]``; we store ``[*in, *out]``):

    copy      stored as ours (embeddings, norms, our own orbax layout)
    flatten   stored flat, ours ``[h, d]`` (q/k/v biases)
    linear    stored ``[prod(out), prod(in)]``, ours ``[*in, *out]`` with ``num_in_axes`` input
              axes: transpose, then split the axes (q_proj ``[h*d, e]`` -> ``[e, h, d]``)

and, before any of them, GGUF's q/k row permutation undone (``permuted_heads``): llama.cpp's
converter interleaves the rotary pairs of each head's rows for ``llama`` models; and a constant
``offset`` taken off (llama.cpp stores Gemma's RMSNorm scales as ``1 + weight``).

A stacked parameter (a MoE layer's experts, ours ``[E, ...]``) is stored as E tensors, one per
expert (``TensorSource.stacked``); each has the layout of our parameter without its leading axis,
so a sliced read of experts ``[a, b)`` reads only tensors ``a .. b - 1``.
"""

from __future__ import annotations

import dataclasses
import math

NAMINGS = ("hf", "gguf", "jaxserve")
"""Tensor naming schemes of checkpoints: Hugging Face's module names (safetensors), llama.cpp's
GGUF names, our orbax layout's (our parameter paths, dotted)."""
LAYOUT_KINDS = ("copy", "flatten", "linear")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a stored tensor becomes one of our parameters (see the module docstring).

    Attributes:
      kind: one of ``LAYOUT_KINDS``.
      num_in_axes: "linear": how many of our leading axes are the torch weight's input.
      permuted_heads: > 0 when the stored rows carry llama.cpp's q/k permutation over this
        many heads (undone first).
      offset: the stored values are ours plus this (subtracted on reading); 0: none.
    """

    kind: str = "copy"
    num_in_axes: int = 0
    permuted_heads: int = 0
    offset: float = 0.0

    def __post_init__(self):
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"kind must be one of {LAYOUT_KINDS}, got {self.kind!r}")
        if (self.kind == "linear") != (self.num_in_axes > 0):
            raise ValueError("num_in_axes must be > 0 exactly for a 'linear' layout")

    def stored_shape(self, our_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape that this layout turns into ``our_shape``."""
        if self.kind == "flatten":
            return (math.prod(our_shape),)
        if self.kind == "linear":
            n = self.num_in_axes
            return (math.prod(our_shape[n:]), math.prod(our_shape[:n]))
        return tuple(our_shape)

    def to_ours(self, x, our_shape: tuple[int, ...]):
        """A stored tensor (numpy or jax, of ``stored_shape(our_shape)``) -> ``our_shape``, same
        dtype and array type."""
        if self.permuted_heads:
            x = unpermute_qk(x, self.permuted_heads)
        if self.offset:
            x = x - self.offset  # a Python float: keeps x's dtype (numpy and jax)
        if self.kind == "flatten":
            return x.reshape(our_shape)
        if self.kind == "linear":
            return x.T.reshape(our_shape)
        return x

    def stored_index(
        self, index: tuple[slice, ...], our_shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        """The slices of the stored tensor that hold ``x[index]`` of our parameter, or None when
        that part is not one contiguous block of the stored tensor (then the whole tensor must
        be read).

        Args:
          index: one ``slice`` per axis of ``our_shape`` (step 1, bounds set: a shard of a
            ``NamedSharding``, as ``jax.make_array_from_callback`` passes it).
          our_shape: our parameter's shape.

        A sharded axis is contiguous in the stored tensor when the axes flattened after it are
        whole (tensor parallelism splits heads, not ``head_dim``); llama.cpp's permuted q/k rows
        need whole heads.
        """
        index = normalize_index(index, our_shape)
        if self.kind == "flatten":
            rows = flat_range(index, our_shape)
            out = None if rows is None else (rows,)
        elif self.kind == "linear":
            n = self.num_in_axes
            rows, cols = flat_range(index[n:], our_shape[n:]), flat_range(index[:n], our_shape[:n])
            out = None if rows is None or cols is None else (rows, cols)
        else:
            out = index
        if out is not None and self.permuted_heads:
            per_head = self.stored_shape(our_shape)[0] // self.permuted_heads
            if out[0].start % per_head or out[0].stop % per_head:
                return None
        return out

    def slice_to_ours(self, x, index: tuple[slice, ...], our_shape: tuple[int, ...]):
        """``x``, the stored slice ``stored_index(index, our_shape)`` -> our ``x[index]``
        (``to_ours`` of a part)."""
        index = normalize_index(index, our_shape)
        shape = tuple(s.stop - s.start for s in index)
        layout = self
        if self.permuted_heads:  # whole heads (stored_index): the slice's own count
            per_head = self.stored_shape(our_shape)[0] // self.permuted_heads
            layout = dataclasses.replace(self, permuted_heads=x.shape[0] // per_head)
        return layout.to_ours(x, shape)

    def to_stored(self, x):
        """Ours -> the stored tensor (the inverse of ``to_ours``; writing checkpoints)."""
        if self.kind == "flatten":
            x = x.reshape(-1)
        elif self.kind == "linear":
            x = x.reshape(math.prod(x.shape[: self.num_in_axes]), -1).T
        if self.permuted_heads:
            x = permute_qk(x, self.permuted_heads)
        if self.offset:
            x = x + self.offset
        return x


COPY = Layout()
FLATTEN = Layout("flatten")

# llama.cpp's tensor names (its ``gguf-py`` tensor_mapping) for the module paths every family
# shares; a family adds its own norms (their roles differ: Llama's ``post_attention_layernorm``
# is llama.cpp's ``ffn_norm``, Gemma's is ``post_attention_norm``).
GGUF_LAYER_NAMES = {
    # our module path after "layers.N." -> GGUF name after "blk.N."
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
GGUF_TOP_NAMES = {"embed_tokens": "token_embd", "lm_head": "output", "norm": "output_norm"}


def gguf_name(module: list[str], leaf: str, layer_names: dict[str, str]) -> str:
    """The GGUF tensor name of our parameter ``module + [leaf]``, e.g. ``["layers", "3",
    "self_attn", "q_proj"], "weight"`` -> ``"blk.3.attn_q.weight"``.

    Args:
      layer_names: the family's map of module paths inside a layer (``GGUF_LAYER_NAMES`` plus
        its norms).

    Raises:
      KeyError: a module the maps do not name.
    """
    if module[0] == "layers":
        return f"blk.{module[1]}.{layer_names['.'.join(module[2:])]}.{leaf}"
    return f"{GGUF_TOP_NAMES[module[0]]}.{leaf}"


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one parameter is stored in a checkpoint.

    Attributes:
      names: the tensor's name; further names are older spellings, tried in order when the
        first is absent (our orbax layout before ``Linear`` layers existed).
      layout: the reshape from the stored tensor to ours.
      stacked: when not empty, our parameter is these tensors (one per index of its leading
        axis: the experts of a MoE layer) stacked along a new axis 0, each turned by ``layout``
        into our shape without that axis; ``names`` is then ``stacked[:1]``.
    """

    names: tuple[str, ...]
    layout: Layout = COPY
    stacked: tuple[str, ...] = ()

    @classmethod
    def stack(cls, names: tuple[str, ...], layout: Layout = COPY) -> TensorSource:
        """A parameter stored as one tensor per index of its leading axis (``stacked``)."""
        return cls(tuple(names[:1]), layout, tuple(names))

    @property
    def name(self) -> str:
        """The current name."""
        return self.names[0]


def unpermute_qk(x, n_head: int):
    """Undoes llama.cpp's q/k row permutation (``[n_head * d, ...]`` rows, or a bias).

    llama.cpp writes row ``h*d + 2*i + j`` from HF row ``h*d + j*d/2 + i`` (j in {0, 1}).
    Works on numpy and jax arrays.
    """
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def permute_qk(x, n_head: int):
    """llama.cpp's q/k row permutation (the inverse of ``unpermute_qk``), for writing GGUFs."""
    rows = x.shape[0]
    return x.reshape(n_head, 2, rows // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def normalize_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``index`` with every slice's bounds set (``slice(None)`` -> ``slice(0, n)``), one per axis
    of ``shape`` (missing trailing axes whole).

    Raises:
      ValueError: a slice with a step other than 1.
    """
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"only step-1 slices can be read, got {s} on axis {i}")
        out.append(slice(start, stop))
    return tuple(out)


def flat_range(index: tuple[slice, ...], dims: tuple[int, ...]) -> slice | None:
    """The range of the flattened (row-major) ``dims`` that ``index`` covers, or None when it is
    not contiguous: the axes before the first one sliced to more than one index must hold one
    index each, and every axis after it must be whole."""
    index = normalize_index(index, dims)
    lengths = [s.stop - s.start for s in index]
    k = next((i for i, n in enumerate(lengths) if n != 1), len(dims) - 1)
    if any(lengths[i] != dims[i] for i in range(k + 1, len(dims))):
        return None
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    start = sum(s.start * st for s, st in zip(index, strides))
    return slice(start, start + math.prod(lengths))


def flat_name(path: tuple) -> str:
    """Our parameter path as a dotted name: ``("layers", 0, "mlp", "up_proj", "weight")`` ->
    ``"layers.0.mlp.up_proj.weight"`` (our orbax layout's names)."""
    return ".".join(str(p) for p in path)
