"""The stand-in accelerator's model (`--simulated-step-ms`): deterministic outputs for the
cost of a few small tensor ops, so that what the host does per step is the executor's own work.

Under `simulated_step_ms` D the executor runs a step as it always does (admission, staging,
the row table and every feature, sampling, the copy of the results) except the model: the
logits of each request's last token (VERIFY: of every token) put all their weight on

    next = (31 * last_input_id + 7 * position + 11) mod vocab_size

(the input id after future-token references are resolved; 0 for embeddings), and the hidden
states are zeros. No K/V is written. The step's results become readable D ms after its
launch (`executor.step.timeline`), the host free meanwhile, as on an accelerator. The tokens
depend only on each step's inputs, so they are the same pipelined or not.
"""

from __future__ import annotations

import torch

from executor.core.forward_batch import ForwardBatch, ForwardMode
from executor.core.names import Path
from executor.core.runner_output import RunnerOutput
from ops.future_tokens import resolve_future_tokens

PEAK = 30.0  # the logit of the stand-in's token (0 elsewhere): sampling draws it too


def standin_token(input_id: int, position: int, vocab_size: int) -> int:
    """The rule in plain Python (for tests and scheduler authors)."""
    return (31 * input_id + 7 * position + 11) % vocab_size


class StandIn:
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        future_tokens: torch.Tensor | None,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dtype = dtype  # the hidden states' (the model's head reads them: prompt logprobs)
        self.future_tokens = future_tokens

    def forward(self, fb: ForwardBatch, layers: tuple[int, ...]) -> RunnerOutput:
        device = fb.seq_lens.device
        ids = fb.input_ids
        positions = fb.positions
        assert positions is not None
        if ids is None:
            ids = torch.zeros(fb.num_tokens, dtype=torch.int64, device=device)
        elif fb.future_refs and self.future_tokens is not None:
            ids = resolve_future_tokens(ids, self.future_tokens)
        if fb.forward_mode is ForwardMode.EXTEND:  # each request's last token
            assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
            last = fb.extend_start_loc + fb.extend_seq_lens - 1
            ids, positions = ids[last], positions[last]
        token = (ids.long() * 31 + positions.long() * 7 + 11) % self.vocab_size
        logits = torch.zeros((token.shape[0], self.vocab_size), dtype=torch.float32, device=device)
        logits.scatter_(1, token.unsqueeze(1), PEAK)
        hidden = torch.zeros((fb.num_tokens, self.hidden_size), dtype=self.dtype, device=device)
        return RunnerOutput(
            logits,
            Path.SIMULATED,
            fb.batch_size,
            fb.num_tokens,
            hidden=hidden,
            layers={i: hidden for i in layers},
        )
