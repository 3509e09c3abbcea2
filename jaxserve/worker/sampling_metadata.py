"""Per-step sampling inputs of a padded batch: a pytree of per-row arrays plus static flags.

The model runner builds one :class:`SamplingMetadata` per step on the host (numpy) and passes it
into its jitted step, where :func:`jaxserve.worker.sampler.sample` consumes it::

    rows = [SamplingRow(params, seed, step_index, output_token_ids, prompt_token_ids), ...]
    md = SamplingMetadata.from_params(rows, pad_to=S, eos_token_id=tokenizer_eos)   # numpy
    out = sample(logits, md)          # inside jit; logits f32[S, V] -> SamplerOutput

Row ``i`` of the batch is ``rows[i]``; rows ``len(rows)..S-1`` are padding (greedy, no
penalties, no bias: they cost nothing extra and their tokens are to be ignored).

Per-row randomness: a row's token depends only on its own logits, its ``seed`` and its
``step_index`` (the output position it is sampling), never on the other rows: the key is
``fold_in(threefry_key(seed), step_index)`` where ``threefry_key(seed)`` has key data
``[(seed mod 2**64) >> 32, seed mod 2**32]`` (equal to ``jax.random.PRNGKey(seed)`` for
``0 <= seed < 2**32``). Requests without a user seed get one from the engine's generator.

Static fields (part of the jit compile key, so a step with a new combination compiles once):

=========================  ==================================================================
``all_greedy``             every row has temperature 0: argmax only, no random bits, no filter
``any_penalties``          some row has a presence/frequency/repetition penalty
``any_logit_bias``         some row has ``logit_bias`` or bans tokens for ``min_tokens``
``max_logprobs``           None (no row asks for logprobs) or the top-n bucket 0 / 5 / 20
``any_top_k_top_p_min_p``  some sampled (temperature > 0) row filters with top-k/top-p/min-p
``needs_full_sort``        some filtering row needs the full rank order over the vocabulary
                           (top_p < 1 without top_k, or top_k > ``PARTIAL_SORT_WIDTH``);
                           otherwise the rank order comes from ``lax.top_k(., 128)``
``any_token_mask``         some row has a token bitmask (structured outputs,
                           allowed_token_ids, bad_words; see ``jaxserve.structured``)
=========================  ==================================================================

The token bitmask is ``int32[S, ceil(V / 32)]`` when ``any_token_mask`` (all bits set on rows
without a mask) and an ``int32[S, 1]`` placeholder otherwise, so unconstrained steps pay
nothing and a constrained step is one more compiled variant per sequence bucket (the mask's
width is fixed by the vocabulary, so the mask never causes a recompile step to step).

Array widths are bucketed too: logit-bias entries ``B`` in ``LOGIT_BIAS_BUCKETS`` (then powers of
two) and penalty histories ``L`` (one width shared by prompt and output ids) in powers of two from
``MIN_PENALTY_WIDTH``; an unused feature gets width-1 placeholders. The variants a runner should
compile ahead of serving, per sequence bucket S, are the everyday ones: all-greedy; sampling
without filters; sampling with top-k <= 128 (partial sort); sampling with a full sort
(top-p) — each with ``max_logprobs`` None (and 5 if logprobs are common). Penalties, logit bias
and larger logprobs buckets compile on first use (one extra variant per (L, B) bucket met).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from pallas_kernels.bucketing import next_power_of_2

PARTIAL_SORT_WIDTH = 128
"""Rank-order width used when every filtering row has ``1 <= top_k <= 128`` (``lax.top_k``)."""

LOGIT_BIAS_BUCKETS = (8, 64, 300)
"""Widths of the sparse logit-bias arrays; larger maps round up to the next power of two."""

LOGPROBS_BUCKETS = (0, 5, MAX_LOGPROBS)
"""Top-n widths computed on device; a request asking for n gets the first n of the bucket."""

MIN_PENALTY_WIDTH = 32
"""Smallest width of the penalty token-history arrays (then powers of two)."""


class SamplingRow(NamedTuple):
    """What the sampler needs to know about one request in this step.

    Attributes:
      params: the request's validated :class:`SamplingParams`.
      seed: the effective seed (the request's, or one the engine drew for it); any int, used
        modulo 2**64.
      step_index: output position being sampled (number of tokens generated so far), >= 0.
      output_token_ids: tokens generated so far (presence/frequency/repetition penalties and
        ``min_tokens``). Read only for its length unless the row has a penalty.
      prompt_token_ids: the prompt's tokens (read only with a repetition penalty).

    Token ids may be lists or int32 numpy arrays; arrays copy faster when penalties are on.
    """

    params: SamplingParams
    seed: int
    step_index: int
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]


def _bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n, else the next power of two >= n."""
    for b in buckets:
        if n <= b:
            return b
    return next_power_of_2(n)


def _check_row_int(name: str, i: int, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} of row {i} must be an integer, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} of row {i} must be in [{lo}, {hi}], got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Sampling knobs of a padded batch of S rows (one row per sequence), as a jax pytree.

    Array fields (S = sequence bucket; numpy from :meth:`from_params`, device arrays inside jit):
      temperature: f32[S]; 0 = greedy.
      top_k: i32[S]; 0 = off. Forced to 0 on greedy rows.
      top_p: f32[S]; 1 = off. Forced to 1 on greedy rows.
      min_p: f32[S]; 0 = off. Forced to 0 on greedy rows.
      presence_penalty, frequency_penalty: f32[S]; 0 = off.
      repetition_penalty: f32[S]; 1 = off.
      rng_key_data: u32[S, 2]; threefry key data of the row's seed (see module docstring).
      step_index: i32[S]; output position, folded into the row's key.
      logit_bias_ids: i32[S, B]; token ids, -1 = no entry.
      logit_bias_values: f32[S, B]; bias added to the logit (-inf bans the token).
      output_token_ids: i32[S, L]; generated tokens, -1 padded (penalty rows only).
      prompt_token_ids: i32[S, L]; prompt tokens, -1 padded (repetition-penalty rows only).
      token_bitmask: i32[S, ceil(V / 32)]; bit t % 32 of word t // 32 set = token t allowed
        (i32[S, 1] placeholder when no row is masked).

    Static fields: ``all_greedy``, ``any_penalties``, ``any_logit_bias``, ``max_logprobs``,
    ``any_top_k_top_p_min_p``, ``needs_full_sort``, ``any_token_mask`` (see the module
    docstring).
    """

    temperature: np.ndarray | jax.Array
    top_k: np.ndarray | jax.Array
    top_p: np.ndarray | jax.Array
    min_p: np.ndarray | jax.Array
    presence_penalty: np.ndarray | jax.Array
    frequency_penalty: np.ndarray | jax.Array
    repetition_penalty: np.ndarray | jax.Array
    rng_key_data: np.ndarray | jax.Array
    step_index: np.ndarray | jax.Array
    logit_bias_ids: np.ndarray | jax.Array
    logit_bias_values: np.ndarray | jax.Array
    output_token_ids: np.ndarray | jax.Array
    prompt_token_ids: np.ndarray | jax.Array
    token_bitmask: np.ndarray | jax.Array
    all_greedy: bool = True
    any_penalties: bool = False
    any_logit_bias: bool = False
    max_logprobs: int | None = None
    any_top_k_top_p_min_p: bool = False
    needs_full_sort: bool = False
    any_token_mask: bool = False

    @classmethod
    def from_params(
        cls,
        rows: Sequence[SamplingRow | tuple],
        pad_to: int,
        *,
        eos_token_id: int | None = None,
        token_bitmask: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Builds the step's metadata on the host with numpy.

        Args:
          rows: one :class:`SamplingRow` (or plain 5-tuple in its field order) per real
            sequence, in batch order.
          pad_to: S, the sequence bucket (>= ``len(rows)``).
          eos_token_id: EOS of the tokenizer; with ``stop_token_ids`` it is banned (logit -inf,
            vLLM's min-tokens logits processor) while a row has fewer than ``min_tokens``
            outputs, unless the request sets ``ignore_eos``.
          token_bitmask: int32 [pad_to, ceil(V / 32)] token masks in batch order (all bits set
            on unmasked rows), or None when no row is masked.

        Work per row is O(1) unless the row uses a feature: penalties copy its token history,
        logit bias copies its map.

        Returns:
          SamplingMetadata with numpy arrays.

        Raises:
          ValueError: ``pad_to`` is smaller than the number of rows, or a row's ``seed`` /
            ``step_index`` is not an integer in range (the message names the field and row).
        """
        n = len(rows)
        if (
            isinstance(pad_to, bool)
            or not isinstance(pad_to, (int, np.integer))
            or pad_to < max(n, 1)
        ):
            raise ValueError(
                f"pad_to must be an integer >= max(1, number of rows) = {max(n, 1)}, got {pad_to!r}"
            )
        b = _RowsBuilder(int(pad_to))
        for i, row in enumerate(rows):
            params, seed, step, output_ids, prompt_ids = row
            b.add_seed(i, seed, step)
            b.add_temperature_and_filters(i, params)
            if (
                params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0
                or params.repetition_penalty != 1.0
            ):
                b.add_penalties(i, params, output_ids, prompt_ids)
            if params.logit_bias or len(output_ids) < params.min_tokens:
                b.add_logit_bias(i, params, len(output_ids), eos_token_id)
            if params.logprobs is not None:
                b.max_logprobs = max(b.max_logprobs or 0, params.logprobs)
        bias_ids, bias_values = b.logit_bias_arrays()
        output_arr, prompt_arr = b.penalty_arrays()
        token_bitmask = _check_token_bitmask(token_bitmask, b.s)
        return cls(
            temperature=b.temperature,
            top_k=b.top_k,
            top_p=b.top_p,
            min_p=b.min_p,
            presence_penalty=b.presence,
            frequency_penalty=b.frequency,
            repetition_penalty=b.repetition,
            rng_key_data=b.key_data,
            step_index=b.step_index,
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
            output_token_ids=output_arr,
            prompt_token_ids=prompt_arr,
            token_bitmask=token_bitmask,
            all_greedy=bool(np.all(b.temperature == 0.0)),
            any_penalties=bool(b.penalty_rows),
            any_logit_bias=bool(b.bias_rows),
            max_logprobs=None
            if b.max_logprobs is None
            else _bucket(b.max_logprobs, LOGPROBS_BUCKETS),
            any_top_k_top_p_min_p=b.any_filter,
            needs_full_sort=b.needs_full_sort,
            any_token_mask=token_bitmask.shape[1] > 1,
        )

    def expand(self, rows: np.ndarray, width: int) -> SamplingMetadata:
        """The metadata of ``len(rows) * width`` rows: row ``rows[i]`` repeated ``width`` times,
        its j-th copy sampling output position ``step_index + j`` (speculative decoding: the
        target's distribution at each of a request's draft positions, with the knobs, seed and
        per-position key of that output index). Host (numpy) metadata only.

        Args:
          rows: int ``[R]`` rows of this metadata.
          width: copies per row (1 + the most drafts a request carries).
        """
        take = np.repeat(np.asarray(rows, np.int64), width)
        arrays = {name: getattr(self, name)[take] for name in _DATA_FIELDS}
        arrays["step_index"] = arrays["step_index"] + np.tile(
            np.arange(width, dtype=np.int32), len(rows)
        )
        return dataclasses.replace(self, **arrays)


def _check_token_bitmask(token_bitmask: np.ndarray | None, s: int) -> np.ndarray:
    """The step's token bitmask, or the ``int32[S, 1]`` placeholder when no row is masked.

    Raises:
      ValueError: not int32 with S rows.
    """
    if token_bitmask is None:
        return np.full((s, 1), -1, np.int32)
    if token_bitmask.shape[0] != s or token_bitmask.dtype != np.int32:
        raise ValueError(
            f"token_bitmask must be int32 [{s}, W], got {token_bitmask.dtype} "
            f"{list(token_bitmask.shape)}"
        )
    return token_bitmask


class _RowsBuilder:
    """The numpy arrays of ``SamplingMetadata.from_params`` for ``s`` rows, filled row by row
    (padding rows keep the neutral values: greedy, no filter, no penalty, no bias)."""

    def __init__(self, s: int) -> None:
        self.s = s
        self.temperature = np.zeros(s, np.float32)
        self.top_k = np.zeros(s, np.int32)
        self.top_p = np.ones(s, np.float32)
        self.min_p = np.zeros(s, np.float32)
        self.presence = np.zeros(s, np.float32)
        self.frequency = np.zeros(s, np.float32)
        self.repetition = np.ones(s, np.float32)
        self.key_data = np.zeros((s, 2), np.uint32)
        self.step_index = np.zeros(s, np.int32)
        self.bias_rows: list[tuple[int, dict[int, float]]] = []
        self.penalty_rows: list[tuple[int, Sequence[int], Sequence[int] | None]] = []
        self.max_logprobs: int | None = None
        self.any_filter = False
        self.needs_full_sort = False

    def add_seed(self, i: int, seed: object, step: object) -> None:
        """Row i's threefry key data and output position (both checked)."""
        seed = _check_row_int("seed", i, seed, -(2**63), 2**64 - 1) % 2**64
        self.key_data[i] = (seed >> 32, seed & 0xFFFFFFFF)
        self.step_index[i] = _check_row_int("step_index", i, step, 0, 2**31 - 1)

    def add_temperature_and_filters(self, i: int, params: SamplingParams) -> None:
        """Temperature; top-k / top-p / min-p only on sampled rows (greedy rows stay neutral)."""
        self.temperature[i] = params.temperature
        if params.temperature > 0.0:
            uses_rank = params.top_k > 0 or params.top_p < 1.0
            if uses_rank or params.min_p > 0.0:
                self.any_filter = True
                self.top_k[i], self.top_p[i], self.min_p[i] = (
                    params.top_k,
                    params.top_p,
                    params.min_p,
                )
            if uses_rank and not 0 < params.top_k <= PARTIAL_SORT_WIDTH:
                self.needs_full_sort = True

    def add_penalties(
        self,
        i: int,
        params: SamplingParams,
        output_ids: Sequence[int],
        prompt_ids: Sequence[int],
    ) -> None:
        """Penalty values, and the token history they need (the prompt only for repetition)."""
        self.presence[i] = params.presence_penalty
        self.frequency[i] = params.frequency_penalty
        self.repetition[i] = params.repetition_penalty
        self.penalty_rows.append(
            (i, output_ids, prompt_ids if params.repetition_penalty != 1.0 else None)
        )

    def add_logit_bias(
        self, i: int, params: SamplingParams, num_output: int, eos_token_id: int | None
    ) -> None:
        """The row's logit_bias, plus -inf on its stop tokens (and EOS unless ignore_eos) while
        it has fewer than min_tokens outputs."""
        bias = params.logit_bias
        if num_output < params.min_tokens:
            banned = set(params.stop_token_ids)
            if eos_token_id is not None and not params.ignore_eos:
                banned.add(eos_token_id)
            if banned:
                bias = {**bias, **{t: -np.inf for t in banned}}
        if bias:
            self.bias_rows.append((i, bias))

    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids i32[S, B], values f32[S, B])``, B bucketed; width 1 when no row has a bias."""
        s = self.s
        if not self.bias_rows:
            return np.full((s, 1), -1, np.int32), np.zeros((s, 1), np.float32)
        width = _bucket(max(len(b) for _, b in self.bias_rows), LOGIT_BIAS_BUCKETS)
        bias_ids = np.full((s, width), -1, np.int32)
        bias_values = np.zeros((s, width), np.float32)
        for i, b in self.bias_rows:
            bias_ids[i, : len(b)] = list(b.keys())
            bias_values[i, : len(b)] = list(b.values())
        return bias_ids, bias_values

    def penalty_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(output ids i32[S, L], prompt ids i32[S, L])``, -1 padded, L bucketed; width 1 when
        no row has a penalty."""
        s = self.s
        if not self.penalty_rows:
            return np.full((s, 1), -1, np.int32), np.full((s, 1), -1, np.int32)
        longest = max(max(len(o), len(p) if p is not None else 0) for _, o, p in self.penalty_rows)
        width = _bucket(max(longest, 1), (MIN_PENALTY_WIDTH,))
        output_arr = np.full((s, width), -1, np.int32)
        prompt_arr = np.full((s, width), -1, np.int32)
        for i, o, p in self.penalty_rows:
            output_arr[i, : len(o)] = o
            if p is not None:
                prompt_arr[i, : len(p)] = p
        return output_arr, prompt_arr


_STATIC_FIELDS = (
    "all_greedy",
    "any_penalties",
    "any_logit_bias",
    "max_logprobs",
    "any_top_k_top_p_min_p",
    "needs_full_sort",
    "any_token_mask",
)
_DATA_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingMetadata) if f.name not in _STATIC_FIELDS
)
jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=list(_DATA_FIELDS), meta_fields=list(_STATIC_FIELDS)
)
