"""The runner's half of speculative decoding: verifying a step's draft tokens, and proposing
the next ones.

Verification (the rejection sampler). A request carrying k drafts ``d_1..d_k`` runs its last
known token and the drafts as 1 + k query tokens; the target's logits at query token j give
its distribution ``p_j`` for output position ``s + j`` (s: the request's output count), given
the prefix with ``d_1..d_j``. Each ``p_j`` is the distribution the ordinary sampler would draw
from at that position (``jaxserve.worker.sampler``: logit_bias, temperature, top-k / top-p /
min-p, the same seed and per-position key ``fold_in(seed, s + j)``), so the sampler draws its
token ``t_j`` at every position exactly as a non-speculative step would. The step keeps
``d_1..d_a`` for the longest prefix with ``t_j == d_{j+1}`` (j < a), then ``t_a``: 1 to k + 1
tokens.

This is the rejection sampling of Leviathan et al. (2023) and Chen et al. (2023) for drafts
proposed deterministically (both proposers here draft greedily: the draft distribution ``q_j``
is a point mass on ``d_{j+1}``). Their rule accepts ``d`` with probability ``min(1, p(d) /
q(d)) = p(d)`` and otherwise draws from the residual ``max(p - q, 0)`` normalised, which is
``p`` without ``d``, renormalised. Drawing ``t ~ p`` once and accepting iff ``t == d`` realises
that law exactly: ``P(accept) = p(d)``, and given a rejection ``t`` is distributed as ``p``
restricted to the other tokens. So every emitted token has the non-speculative distribution
(tests/worker/test_spec_decode.py checks it with a chi-square test), and since the draws use
the non-speculative keys, a seeded request gives the same tokens with speculation on and off;
greedy rows (argmax) are the special case that needs no draws.

Shapes: verification works on R rows (the step's requests with drafts, padded to a power of
two, so its compiles do not depend on the batch's other requests) of ``W = K + 1`` positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker.batch_builder import StepBatch
from pallas_kernels.bucketing import next_power_of_2


@dataclasses.dataclass
class VerifyPlan:
    """Which tokens of a step are verified, built on the host from the step's batch.

    Attributes:
      seqs: ``[n]`` int, the step's sequences that carry drafts.
      num_spec: ``[n]`` int, their draft counts (1..K).
      rows: ``[R]`` int, ``seqs`` padded to R (a power of two) with its first entry: the rows of
        the step's sampling metadata that ``SamplingMetadata.expand`` repeats.
      drafts: ``[R, K]`` int32, each row's draft tokens, -1 padded (padding rows repeat the
        first row).
      indices: ``[R * W]`` int32, the step token each verified position reads its logits at:
        row r, position j -> the (j)-th of its last k + 1 tokens (j > k repeats the last).
      width: W = K + 1.
    """

    seqs: np.ndarray
    num_spec: np.ndarray
    rows: np.ndarray
    drafts: np.ndarray
    indices: np.ndarray
    width: int

    @property
    def num_rows(self) -> int:
        """R, the padded row count."""
        return len(self.rows)


def plan_verification(batch: StepBatch, k: int) -> VerifyPlan | None:
    """The VerifyPlan of a step (None when no request carries drafts).

    Args:
      batch: the step's StepBatch (``num_spec`` set by the batch builder).
      k: K, the most drafts a request carries (``num_speculative_tokens``).
    """
    num_spec = batch.num_spec
    if num_spec is None:
        return None
    seqs = np.flatnonzero(num_spec > 0)
    if seqs.size == 0:
        return None
    n = seqs.size
    width = k + 1
    r = next_power_of_2(n)
    rows = np.concatenate([seqs, np.full(r - n, seqs[0])])
    counts = num_spec[rows]
    first = (np.cumsum(batch.num_scheduled) - 1)[rows] - counts  # the known token's index
    pos = np.minimum(np.arange(width)[None, :], counts[:, None])  # [R, W]
    indices = (first[:, None] + pos).astype(np.int32).ravel()
    ids = batch.inputs.input_ids
    drafts = np.full((r, k), -1, np.int32)
    for i in range(n):  # n <= the step's requests, each a slice of at most K ids
        c = int(counts[i])
        drafts[i, :c] = ids[first[i] + 1 : first[i] + 1 + c]
    drafts[n:] = drafts[0]
    return VerifyPlan(seqs, num_spec[seqs], rows, drafts, indices, width)


def accept(plan: VerifyPlan, token_ids: np.ndarray) -> list[list[int]]:
    """Each drafted sequence's tokens: the drafts its sampled tokens agree with, then its own.

    Args:
      plan: the step's VerifyPlan.
      token_ids: int ``[R * W]``, the sampler's token at each verified position.

    Returns:
      Per entry of ``plan.seqs``, ``[d_1, ..., d_a, t_a]`` (1 to k + 1 tokens).
    """
    n, k = plan.seqs.size, plan.width - 1
    t = np.asarray(token_ids).reshape(plan.num_rows, plan.width)[:n]
    agree = t[:, :k] == plan.drafts[:n]  # -1 padding never agrees
    num_accepted = np.cumprod(agree, axis=1).sum(axis=1)
    return [t[i, : num_accepted[i] + 1].tolist() for i in range(n)]


@jax.jit
def accept_on_device(
    last_tokens: jax.Array, token_ids: jax.Array, rows: jax.Array, drafts: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``accept`` on the device, for a proposer that continues from the accepted tokens
    without a host round trip (the draft model).

    Args:
      last_tokens: int32 ``[S_max]``, each sequence's sampled token (the ordinary sampler's,
        padded; a drafted sequence's entry is replaced).
      token_ids: int32 ``[R * W]``, the sampler's tokens at the verified positions.
      rows: int32 ``[R]`` (``VerifyPlan.rows``), drafts: int32 ``[R, K]`` (``VerifyPlan.drafts``).

    Returns:
      ``(last [S_max], num_accepted [S_max])``: each sequence's last kept token and how many of
      its drafts were accepted (0 for sequences without drafts).
    """
    r, k = drafts.shape
    t = token_ids.reshape(r, k + 1)
    num_accepted = jnp.sum(jnp.cumprod(t[:, :k] == drafts, axis=1), axis=1).astype(jnp.int32)
    last = jnp.take_along_axis(t, num_accepted[:, None], axis=1)[:, 0]
    # padding rows repeat the first row: the same values written twice
    last_tokens = last_tokens.at[rows].set(last)
    accepted = jnp.zeros_like(last_tokens).at[rows].set(num_accepted)
    return last_tokens, accepted
