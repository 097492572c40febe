"""Prompt logprobs (SamplingParams.prompt_logprobs, as vLLM's): at every prompt position
after the first, the prompt token's logprob and rank, and the k most likely tokens there.

The final hidden state at position j predicts token j + 1, so a step that computes
positions [c, c + s) of a prompt of P tokens gives the rows of prompt positions c + 1 ..
min(c + s, P - 1): a chunked prefill gives its rows over several steps, each in the step
that computes them. The logits are made a chunk of rows at a time, so a long prompt never
holds [prompt, vocab] float32 logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from messages import LogprobsLists, PromptLogprobs
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.models.registry import CausalLM

# The most float32 logits (bytes) one chunk of rows holds.
CHUNK_BYTES = 64 << 20


@dataclass
class PromptPlan:
    """The prompt positions a step computes logprobs for, one row each."""

    token_index: np.ndarray  # int64 [r]: the step's token whose hidden state predicts it
    targets: np.ndarray  # int64 [r]: the prompt token at the position
    handles: np.ndarray  # int32 [m]: the requests, in step order
    first_positions: np.ndarray  # int32 [m]: the prompt position of each one's first row
    num_rows: np.ndarray  # int32 [m]
    num_top: int  # k: the largest prompt_logprobs among them


def plan_prompt_logprobs(batch: InputBatch, step: ScheduledRequests) -> PromptPlan | None:
    """The rows of this step's requests that ask for prompt logprobs; None: none."""
    asked = batch.num_prompt_logprobs[step.rows]
    wanting = np.flatnonzero(asked >= 0)
    if not len(wanting):
        return None
    starts = np.cumsum(step.num_scheduled) - step.num_scheduled  # each one's first token
    index, targets, handles, firsts, counts = [], [], [], [], []
    for i in wanting.tolist():
        row, computed = int(step.rows[i]), int(step.num_computed[i])
        end = min(computed + int(step.num_scheduled[i]), int(batch.num_prompt[row]) - 1)
        if end <= computed:
            continue  # past its prompt (decoding, or recomputing its outputs)
        first = int(starts[i])
        index.append(np.arange(first, first + end - computed))
        targets.append(batch.token_ids[row, computed + 1 : end + 1])
        handles.append(int(step.handles[i]))
        firsts.append(computed + 1)
        counts.append(end - computed)
    if not handles:
        return None
    return PromptPlan(
        np.concatenate(index),
        np.concatenate(targets).astype(np.int64),
        np.array(handles, np.int32),
        np.array(firsts, np.int32),
        np.array(counts, np.int32),
        int(asked[wanting].max()),
    )


def prompt_logprobs(model: CausalLM, hidden: torch.Tensor, plan: PromptPlan) -> PromptLogprobs:
    """The plan's rows from the final hidden states of its token_index positions, on the
    host (a request that asks waits for them: they are few)."""
    chunk = max(1, CHUNK_BYTES // (4 * model.vocab_size))
    targets = torch.from_numpy(plan.targets).to(hidden.device)
    ids, values, ranks = [], [], []
    with torch.inference_mode():
        for start in range(0, len(hidden), chunk):
            logprobs = model.compute_logits(hidden[start : start + chunk]).float()
            logprobs -= logprobs.logsumexp(dim=-1, keepdim=True)
            target = targets[start : start + chunk].unsqueeze(1)
            chosen = logprobs.gather(1, target)
            # Rank 1 is the most likely token: count the tokens strictly more likely.
            ranks.append((logprobs > chosen).sum(dim=-1) + 1)
            top_values, top_ids = logprobs.topk(plan.num_top, dim=-1)
            ids.append(torch.cat([target, top_ids], dim=1))
            values.append(torch.cat([chosen, top_values], dim=1))
    rows = LogprobsLists(
        torch.cat(ids).to(torch.int32).cpu().numpy(),
        torch.cat(values).cpu().numpy(),
        torch.cat(ranks).to(torch.int32).cpu().numpy(),
    )
    return PromptLogprobs(plan.handles, plan.first_positions, plan.num_rows, rows)
