"""On-device sampling with OpenAI/vLLM semantics, traceable inside the runner's jitted step.

Public API::

    out = sample(logits, md)            # logits f32[S, V], md: SamplingMetadata -> SamplerOutput
    out.token_ids                        # i32[S]; rows >= the real batch are padding, ignore them
    out.logprobs                         # LogprobsTensors or None (md.max_logprobs is None)
    lp = prompt_logprobs(logits, next_token_ids, n)   # f32[T, V], i32[T] -> LogprobsTensors
    probs = sampling_probs(logits, md)   # f32[S, V], the distribution ``sample`` draws from
    x = penalized_logits(logits, md)     # f32[S, V], logits after logit_bias and penalties
    lp = gather_logprobs(logprobs, token_ids, n)      # f32[R, V], i32[R] -> LogprobsTensors

All are pure jnp functions meant to be traced inside the runner's jitted step (``md`` is an
argument of that step: its arrays are traced, its flags are static). ``n`` is static.

Order of the knobs (the contract in :mod:`jaxserve.sampling_params`; vLLM V1's sampler order):

1. ``logit_bias`` is added (including -inf bans from ``min_tokens``).
   Tokens the row's token bitmask disallows (structured outputs, ``allowed_token_ids``,
   ``bad_words``) get -inf, so greedy and sampled rows alike only ever pick allowed tokens.
2. Repetition penalty over tokens seen in prompt or output: positive logits are divided by it,
   the others multiplied (CTRL, arXiv:1909.05858; HF/vLLM). Then the frequency penalty
   subtracts ``penalty * count`` and the presence penalty subtracts ``penalty`` once for each
   token present in the output (OpenAI API reference).
3. Rows with temperature 0 take the argmax of these logits (ties -> smallest token id).
4. Other rows divide by the temperature, then keep tokens by rank. The rank order is
   probability descending, ties broken by smaller token id. top-k keeps the first k ranks;
   top-p keeps the shortest prefix of the (top-k renormalised) ranks whose mass reaches
   ``top_p``, always at least the first (``top_p == 1`` is off, ``top_p == 0`` keeps one);
   min-p drops tokens whose probability is below ``min_p`` times the top one's.
5. A token is drawn by inverse-CDF sampling: one uniform ``u`` in (0, 1] per row from the row's
   own key ``fold_in(key(seed), step_index)`` (so it does not depend on the other rows in the
   batch), and the first token whose cumulative probability reaches ``u`` times the total. One
   random number per row instead of one per vocabulary entry (Gumbel-max) keeps the sampler
   cheap at large vocabularies; a token of probability 0 is never drawn.

Differences from vLLM worth knowing: ties at the top-k / top-p boundary are broken by token id
(vLLM keeps all tokens tied with the k-th), so the kept set is always exactly a rank prefix.

Logprobs are those of the raw model distribution, ``log_softmax(logits)`` before bias,
penalties, temperature and filtering (vLLM's default ``logprobs_mode="raw_logprobs"``). The
sampled token's rank is its 1-based position in the rank order (1 = most likely; ties by token
id, so a token listed at top-n position j has rank j + 1). vLLM instead counts every token with
a logprob >= the sampled one's.

Cost: the rank order is one ``lax.top_k(., 128)`` per row when every filtering row has
``top_k <= 128`` (min-p alone also takes this path), one full stable sort per row otherwise,
and nothing when no row filters; min-p itself is elementwise. All-greedy batches are one argmax
and draw no random bits. (Static flags in
:class:`~jaxserve.worker.sampling_metadata.SamplingMetadata`.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.worker.sampling_metadata import PARTIAL_SORT_WIDTH, SamplingMetadata


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_logprobs", "token_ranks", "top_ids", "top_logprobs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of chosen tokens and the top-n alternatives, for R rows.

    Attributes:
      token_logprobs: f32[R], log-probability (nats) of the chosen token under the raw model
        distribution.
      token_ranks: i32[R], 1-based rank of the chosen token (1 = most likely, ties by token id).
      top_ids: i32[R, N], the N most likely token ids, most likely first (ties by token id).
      top_logprobs: f32[R, N], their log-probabilities.
    """

    token_logprobs: jax.Array
    token_ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["token_ids", "logprobs"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What one sampling step returns.

    Attributes:
      token_ids: i32[S], the sampled token of each row (padding rows: unspecified, ignore).
      logprobs: per-row logprobs with N = ``md.max_logprobs`` alternatives, or None when no
        row asked for logprobs. A request asking for n <= N takes the first n columns.
    """

    token_ids: jax.Array
    logprobs: LogprobsTensors | None


def gather_logprobs(logprobs: jax.Array, token_ids: jax.Array, n: int) -> LogprobsTensors:
    """Logprob and rank of ``token_ids`` plus the top-``n`` of each row.

    Args:
      logprobs: f32[R, V], normalised log-probabilities.
      token_ids: i32[R], the chosen token of each row.
      n: static number of top alternatives (0 gives [R, 0] arrays).

    Returns:
      LogprobsTensors with N = n.
    """
    token_lp = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)  # [R, 1]
    vocab = lax.broadcasted_iota(jnp.int32, logprobs.shape, 1)
    ahead = (logprobs > token_lp) | ((logprobs == token_lp) & (vocab < token_ids[:, None]))
    ranks = 1 + jnp.sum(ahead, axis=-1, dtype=jnp.int32)
    if n > 0:
        top_lp, top_ids = lax.top_k(logprobs, n)
    else:
        top_lp = jnp.zeros((logprobs.shape[0], 0), logprobs.dtype)
        top_ids = jnp.zeros((logprobs.shape[0], 0), jnp.int32)
    return LogprobsTensors(token_lp[:, 0], ranks, top_ids.astype(jnp.int32), top_lp)


def prompt_logprobs(logits: jax.Array, next_token_ids: jax.Array, n: int) -> LogprobsTensors:
    """Prompt logprobs: how likely the model found each next prompt token (raw distribution).

    Args:
      logits: f32[T, V], logits at T prompt positions.
      next_token_ids: i32[T], the prompt token that follows each position.
      n: static number of top alternatives (``SamplingParams.prompt_logprobs``, 0..20).

    Returns:
      LogprobsTensors over T rows: the next token's logprob and rank, the top-n ids/logprobs.
    """
    return gather_logprobs(
        jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), next_token_ids.astype(jnp.int32), n
    )


def _row_scatter_index(ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(row, column) scatter indices for ids [S, W]; -1 padding points past the vocabulary."""
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    return rows, jnp.where(ids < 0, vocab_size, ids)


def allowed_tokens(token_bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool[S, V] from a packed mask i32[S, W]: token t is bit t % 32 of word t // 32
    (tokens past 32 * W are not allowed)."""
    s, w = token_bitmask.shape
    shifts = lax.broadcasted_iota(jnp.int32, (1, 1, 32), 2)
    bits = (token_bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]; arithmetic shift, then bit 0
    bits = bits.reshape(s, w * 32).astype(jnp.bool_)
    if w * 32 >= vocab_size:
        return bits[:, :vocab_size]
    return jnp.pad(bits, ((0, 0), (0, vocab_size - w * 32)))


def penalized_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Logits after logit_bias, the token bitmask and the repetition/frequency/presence
    penalties.

    Args:
      logits: f32[S, V].
      md: the step's metadata.

    Returns:
      f32[S, V]; ``logits`` itself when no row uses bias, a mask or penalties.
    """
    x = logits.astype(jnp.float32)
    s, v = x.shape
    if md.any_logit_bias:
        rows, cols = _row_scatter_index(md.logit_bias_ids, v)
        x = x.at[rows, cols].add(md.logit_bias_values, mode="drop")
    if md.any_token_mask:
        x = jnp.where(allowed_tokens(md.token_bitmask, v), x, -jnp.inf)
    if md.any_penalties:
        rows, cols = _row_scatter_index(md.output_token_ids, v)
        counts = jnp.zeros((s, v), jnp.int32).at[rows, cols].add(1, mode="drop")
        rows, cols = _row_scatter_index(md.prompt_token_ids, v)
        in_prompt = jnp.zeros((s, v), jnp.bool_).at[rows, cols].set(True, mode="drop")
        in_output = counts > 0
        rep = md.repetition_penalty[:, None]
        x = jnp.where(in_prompt | in_output, jnp.where(x > 0, x / rep, x * rep), x)
        x = x - md.frequency_penalty[:, None] * counts.astype(jnp.float32)
        x = x - md.presence_penalty[:, None] * in_output.astype(jnp.float32)
    return x


def _rank_mask(scaled: jax.Array, md: SamplingMetadata) -> jax.Array:
    """bool[S, V]: tokens kept by top-k then top-p (all True on rows using neither)."""
    s, v = scaled.shape
    if md.needs_full_sort:
        width = v
        vocab = lax.broadcasted_iota(jnp.int32, (s, v), 1)
        neg_sorted, sorted_ids = lax.sort((-scaled, vocab), dimension=1, num_keys=1, is_stable=True)
        sorted_vals = -neg_sorted
    else:
        width = min(PARTIAL_SORT_WIDTH, v)
        sorted_vals, sorted_ids = lax.top_k(scaled, width)  # descending, ties -> lower id
    pos = lax.broadcasted_iota(jnp.int32, (s, width), 1)
    top_k = md.top_k[:, None]
    keep_k = (top_k <= 0) | (pos < top_k)
    probs = jax.nn.softmax(jnp.where(keep_k, sorted_vals, -jnp.inf), axis=-1)
    # Exclusive prefix sum: the mass of the ranks before each position.
    mass_before = jnp.concatenate(
        [jnp.zeros((s, 1), probs.dtype), jnp.cumsum(probs, axis=-1)[:, :-1]], axis=-1
    )
    top_p = md.top_p[:, None]
    keep_p = (mass_before < top_p) | (top_p >= 1.0) | (pos == 0)
    num_keep = jnp.sum(keep_k & keep_p, axis=-1, keepdims=True)  # [S, 1], >= 1
    last_val = jnp.take_along_axis(sorted_vals, num_keep - 1, axis=-1)
    last_id = jnp.take_along_axis(sorted_ids, num_keep - 1, axis=-1)
    vocab = lax.broadcasted_iota(jnp.int32, (s, v), 1)
    # A token is within the first num_keep ranks iff it sorts no later than the last kept one.
    kept = (scaled > last_val) | ((scaled == last_val) & (vocab <= last_id))
    uses_rank = (md.top_k > 0) | (md.top_p < 1.0)
    return kept | ~uses_rank[:, None]


def _filtered_scaled_logits(x: jax.Array, md: SamplingMetadata) -> jax.Array:
    """f32[S, V]: (x - row max) / temperature with filtered tokens at -inf (sampled rows)."""
    temperature = md.temperature[:, None]
    # Subtracting the row max first keeps tiny temperatures from overflowing to inf.
    scaled = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.where(temperature > 0, temperature, 1.0)
    if not md.any_top_k_top_p_min_p:
        return scaled
    keep = _rank_mask(scaled, md)
    # min-p: p / p_max = exp(scaled - 0); top-k/top-p renormalisation leaves the ratio unchanged.
    keep = keep & (jnp.exp(scaled) >= md.min_p[:, None])
    return jnp.where(keep, scaled, -jnp.inf)


def sampling_probs(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The distribution each row's token is drawn from, f32[S, V].

    Greedy rows (temperature 0) get a one-hot at the argmax of the penalized logits; the others
    ``softmax`` of the temperature-scaled, filtered logits. For tests and diagnostics; ``sample``
    draws from exactly this distribution.
    """
    x = penalized_logits(logits, md)
    greedy = jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)
    if md.all_greedy:
        return greedy
    probs = jax.nn.softmax(_filtered_scaled_logits(x, md), axis=-1)
    return jnp.where(md.temperature[:, None] == 0.0, greedy, probs)


def _row_keys(md: SamplingMetadata) -> jax.Array:
    """Typed PRNG keys [S]: fold_in(threefry key of the row's seed, its step index)."""
    keys = jax.random.wrap_key_data(md.rng_key_data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, md.step_index)


def _inverse_cdf_draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row of ``softmax(logits)`` (f32[S, V], -inf = excluded) -> i32[S].

    Picks the first index whose cumulative probability reaches ``u * total`` with ``u`` in
    (0, 1]; since the cumulative sum is flat over excluded tokens, the picked token always has
    a positive probability (the cumulative sum just before it is below the threshold).
    """
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [S, V], -inf -> 0
    cdf = jnp.cumsum(probs, axis=-1)  # [S, V]
    # One more split before the draw: the first word of fold_in(key(seed), step) over
    # consecutive seeds is measurably less uniform than a split-off key's.
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(jax.random.split(k)[1], (), jnp.float32))(keys)
    threshold = u * cdf[:, -1]  # <= cdf[:, -1]
    return jnp.sum(cdf < threshold[:, None], axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    """Samples one token per row on device (see the module docstring for the semantics).

    Args:
      logits: f32[S, V] (any float dtype; computed in f32), one row per sequence of the padded
        batch, e.g. ``model.compute_logits(hidden[logits_indices])``.
      md: the step's :class:`SamplingMetadata` with S rows (``md.temperature.shape[0] == S``).

    Returns:
      SamplerOutput: token ids i32[S] and, when ``md.max_logprobs`` is not None, raw-model
      logprobs of the sampled tokens with ``md.max_logprobs`` top alternatives.
    """
    logits = logits.astype(jnp.float32)
    x = penalized_logits(logits, md)
    token_ids = jnp.argmax(x, axis=-1).astype(jnp.int32)  # first maximum: ties -> lowest id
    if not md.all_greedy:
        filtered = _filtered_scaled_logits(x, md)
        drawn = _inverse_cdf_draw(_row_keys(md), filtered)
        token_ids = jnp.where(md.temperature == 0.0, token_ids, drawn)
    logprobs = None
    if md.max_logprobs is not None:
        logprobs = gather_logprobs(jax.nn.log_softmax(logits, axis=-1), token_ids, md.max_logprobs)
    return SamplerOutput(token_ids, logprobs)
