"""The embedded engine's full next-token distributions at chosen positions of a sequence.

A full-vocabulary parity check (`palaestra.run.parity`) compares the distribution the engine
sampled from with the trainer's, over the whole vocabulary rather than the sampled token alone.
`FullLogprobsRequest` names a sequence, the positions whose distribution is wanted and the
sampling temperature; `full_logprobs` answers with ``log_softmax(logits / T)`` at each of them.

How the engine side is obtained: the engine re-runs its own forward on the sequence (one
cache-free prefill of the engine's decoder, its current weights and adapters) and turns the
logits into log-probabilities with `sampling.sampling_log_probs`, the function its sampler
draws from. In bitwise mode (``trainer.on_policy = "bitwise"``) that forward is the
batch-invariant one the decode steps and prefill chunks ran, so a token's logits have the bits
they had when it was sampled, whatever batch it was sampled in (`tests/engines/test_bitwise.py`
checks decode steps, prefill chunks and prefix-cache hits against a whole-sequence forward): the
answer *is* the distribution sampling used. In the default mode the re-run is the engine's
prefill kernels over this one sequence, which round differently from the batched decode step
that sampled; the check reports how far that is from the sampled token's logprob as well
(`palaestra.run.parity`, ``rollout/full_vocab_replay_max_abs_diff``).

Logit biases and logits processors of the sampled requests are not applied (a training run sets
none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.model import Decoder


@dataclass(frozen=True)
class FullLogprobsRequest:
    """The next-token distributions of ``token_ids`` at ``positions``: position ``t`` gives the
    distribution of token ``t`` given tokens ``0..t-1`` (so ``1 <= t < len(token_ids)``), at
    ``temperature`` (0: greedy, read at T = 1 like the sampled logprobs)."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    temperature: float = 1.0

    @classmethod
    def of(cls, token_ids: Sequence[int], positions: Sequence[int], temperature: float = 1.0
           ) -> FullLogprobsRequest:
        """A checked request (`check` raises on a bad one)."""
        request = cls(tuple(int(t) for t in token_ids), tuple(int(p) for p in positions),
                      float(temperature))
        request.check()
        return request

    def check(self, max_len: int | None = None) -> None:
        """Refuse a request the engine cannot answer, saying what to change."""
        n = len(self.token_ids)
        if not self.positions:
            raise EngineError("a full-logprobs request needs at least one position")
        bad = [p for p in self.positions if not 1 <= p < n]
        if bad:
            raise EngineError(f"full-logprobs positions {bad[:3]} are outside 1..{n - 1}: "
                              "position t asks for the distribution of token t given the "
                              "tokens before it")
        if max_len is not None and n > max_len:
            raise EngineError(f"the sequence has {n} tokens, more than the engine's "
                              f"max_model_len {max_len}")
        if self.temperature < 0:
            raise EngineError(f"temperature {self.temperature} < 0")


def full_logprobs(decoder: Decoder, request: FullLogprobsRequest, *, invariant: bool,
                  lora: str | None = None) -> torch.Tensor:
    """Float32 ``[len(positions), V]`` log-probabilities on the decoder's device; ``invariant``:
    the sampler's bitwise-mode log-softmax; ``lora``: a loaded adapter's name (None: the default
    adapter, if any). Runs on the engine's compute thread."""
    import torch

    from palaestra.engines.local.sampling import sampling_log_probs

    device = decoder.embed.device
    tokens = torch.tensor(request.token_ids, dtype=torch.long, device=device)
    rows = torch.tensor(request.positions, dtype=torch.long, device=device) - 1
    runtime = decoder.lora
    if lora is not None and runtime is None:
        raise EngineError(f"no LoRA adapter named {lora!r} is loaded (none are)")
    if runtime is not None:  # the default adapter is what requests that name none sampled with
        adapter = runtime.default if lora is None else runtime.id_of(lora)
        runtime.set_rows([adapter], [len(request.token_ids)])
    try:
        logits = decoder.prefill_full(tokens, rows).float()
    finally:
        if runtime is not None:
            runtime.clear_rows()
    t = request.temperature if request.temperature > 1e-6 else 1.0
    temps = torch.full((rows.shape[0],), t, dtype=torch.float32, device=device)
    return sampling_log_probs(logits, temps, invariant=invariant)


__all__ = ["FullLogprobsRequest", "full_logprobs"]
